"""Trainer exports: a consolidated dataset version rewritten in a trainer's own offline format.

One module per format (specforge, modelopt, speculators); the writer
and the export index are in tasks.exports.writer. ``python -m tasks.exports VERSION_DIR NAME``
writes or refreshes an export on demand from the native shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tasks.exports.modelopt import MODELOPT
from tasks.exports.specforge import SPECFORGE
from tasks.exports.speculators import SPECULATORS
from tasks.exports.writer import (
    EXPORT_INDEX_NAME,
    ExportError,
    ExportSummary,
    ExportUnsupported,
    PerSampleFileExport,
    write_per_sample_files,
)
from tasks.training_set import DatasetInfo, TrainingSetDataset, read_dataset_json, write_dataset_json

__all__ = ["EXPORTS", "EXPORT_INDEX_NAME", "ExportError", "ExportSummary", "ExportUnsupported", "check_exports",
           "run_export"]

EXPORTS: dict[str, PerSampleFileExport] = {e.name: e for e in (SPECFORGE, MODELOPT, SPECULATORS)}


def check_exports(names: Sequence[str], info: DatasetInfo) -> None:
    """Raise before any work if an export is unknown or cannot be made from data described by ``info``."""
    for name in names:
        if name not in EXPORTS:
            raise ExportError(f"unknown export {name!r} for dataset version {info.fingerprint}; "
                              f"known: {sorted(EXPORTS)}")
        EXPORTS[name].check(info)


def run_export(name: str, version_dir: Path) -> ExportSummary:
    """Bring ``{version_dir}/exports/{name}/`` in line with the version's manifest, then list it in dataset.json."""
    version_dir = Path(version_dir).resolve()  # {out}/latest: the version it names now, even if a run moves it
    dataset = TrainingSetDataset(version_dir)
    check_exports([name], dataset.info)
    summary = write_per_sample_files(EXPORTS[name], dataset)
    data = read_dataset_json(version_dir)
    write_dataset_json(version_dir, {**data, "exports": sorted({*data.get("exports", []), name})})
    return summary
