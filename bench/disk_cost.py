"""Disk cost per token of each storage configuration of a consolidated dataset version.

    python -m bench.disk_cost out/versions/<fingerprint> [...]

Writes the SpecForge, ModelOpt and speculators exports on demand (python -m tasks.exports) where they
are missing, then prints one markdown row per configuration: bytes on disk (file sizes
under the folders), bytes per token, and that over the tensor bytes a trainer reads
(ids, mask, aux and both final states in the extracted dtype). The native store is the shards plus the manifest,
dataset.json and the vocabulary files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tasks.exports import run_export
from tasks.training_set import read_dataset_json

EXPORTS = ("specforge", "modelopt", "speculators")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def rows(version_dir: Path) -> list[str]:
    data = read_dataset_json(version_dir)
    for name in EXPORTS:
        if name not in data["exports"]:
            run_export(name, version_dir)
    tokens, tensor_bytes = data["tokens"], data["bytes"]
    native = sum(tree_bytes(p) for p in version_dir.iterdir() if p.name not in ("exports", "runs", "rejects.jsonl"))
    dtype = data["dtype"] if data["store_dtype"] == data["dtype"] else f"{data['dtype']} stored as {data['store_dtype']}"
    configs = [(f"native shards only (default), {dtype}", native)]
    for name in EXPORTS:  # exports hold the extracted dtype: their trainers' readers do not dequantize
        export = tree_bytes(version_dir / "exports" / name)
        configs.append((f"{name} export alone, {data['dtype']}", export))
        configs.append((f"native + {name} export (`--exports {name}`), {dtype}", native + export))
    return [f"| {label} | {size:,} | {size / tokens:,.0f} | {size / tensor_bytes:.3f} |" for label, size in configs]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.disk_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("version_dirs", nargs="+", type=Path)
    a = p.parse_args(argv)
    print("| configuration | bytes | bytes/token | x tensor bytes |")
    print("|---|---|---|---|")
    for version_dir in a.version_dirs:
        print("\n".join(rows(version_dir)))


if __name__ == "__main__":
    main()
