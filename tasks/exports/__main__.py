"""Write or refresh trainer exports of a consolidated dataset version from its native shards.

    python -m tasks.exports out/latest specforge [modelopt]       # or out/versions/<fingerprint>

Incremental: files already in line with the manifest are kept. Refused while a run writes
the version (its lock: tasks.dataset_version.version_lock). Delete the export folder
when training is done; this command writes it again whenever it is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tasks.dataset_version import VersionBusy, lock_holder, version_lock
from tasks.exports import EXPORTS, check_exports, run_export
from tasks.training_set import read_dataset_info


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m tasks.exports", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("version_dir", type=Path, help="a dataset version folder: out/versions/<fingerprint>, or "
                                                  "out/latest (the version of the last completed run)")
    p.add_argument("exports", nargs="+", choices=sorted(EXPORTS))
    a = p.parse_args(argv)
    version_dir = a.version_dir.resolve()  # out/latest: one version for all the exports asked for
    check_exports(a.exports, read_dataset_info(version_dir))
    with version_lock(version_dir, lock_holder(command=f"python -m tasks.exports {' '.join(a.exports)}")):
        return [asdict(run_export(name, version_dir)) for name in a.exports]


if __name__ == "__main__":
    try:
        print(json.dumps(main(), indent=2))
    except VersionBusy as exc:
        sys.exit(f"python -m tasks.exports: {exc}")
