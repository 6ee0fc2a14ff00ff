"""The training-set layout: shards, manifest, dataset metadata and the loader. One module, one spec.

A dataset version folder (``{out}/versions/{fingerprint}/``, see tasks.dataset_version) holds::

    shards/{name}.safetensors   one per extraction batch, written once, never modified
    manifest.parquet            one row per sample of the dataset (what a trainer reads)
    dataset.json                DatasetInfo, counts, schema version
    exports/{trainer}/          the same samples in a trainer's own format (tasks.exports); the
                                folders dataset.json's "exports" names match the manifest, any
                                other is from an earlier consolidation

Shards: tasks.shards.

Manifest columns: sample_key, source_id, num_tokens, num_supervised, shard (file name under
shards/), offset_start, offset_end (token rows in that shard), content_hash; sorted by sample_key.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl
import torch
from safetensors import SafetensorError, safe_open

from tasks.dataset_version import SCHEMA_VERSION
from tasks.shards import (
    HIDDEN_DTYPES,
    ShardCorrupt,
    TrainingSetError,
    list_shards,
    read_shard_index,
    read_shard_layout,
)

DATASET_FORMAT = "eagle3-training-set"
MANIFEST_NAME = "manifest.parquet"
DATASET_INFO_NAME = "dataset.json"

MANIFEST_SCHEMA = {
    "sample_key": pl.String, "source_id": pl.String, "num_tokens": pl.Int64, "num_supervised": pl.Int64,
    "shard": pl.String, "offset_start": pl.Int64, "offset_end": pl.Int64, "content_hash": pl.String,
}



# --------------------------------------------------------------------------- errors


class SchemaMismatch(TrainingSetError):
    """Shards of one version disagree with the version's DatasetInfo (dtype, widths)."""


class MissingSamples(TrainingSetError):
    """Samples the caller wants in the dataset are in no shard."""


# --------------------------------------------------------------------------- dataset metadata


@dataclass(frozen=True)
class DatasetInfo:
    model: str
    layer_ids: list[int]
    layer_convention: str   # patches.dumps.LAYER_CONVENTION: ids index HF hidden_states (input of layer i)
    final_norm: str         # "post_norm": final_hidden_states are after the model's final norm
    dtype: str
    hidden_size: int
    num_layers: int
    template_hash: str
    max_length: int
    project_version: str
    fingerprint: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return HIDDEN_DTYPES[self.dtype]


@dataclass(frozen=True)
class ExportSummary:
    name: str
    path: str
    samples: int
    written: int
    unchanged: int
    removed: int


@dataclass(frozen=True)
class ConsolidationSummary:
    version_dir: str
    samples: int
    tokens: int
    supervised_tokens: int
    bytes: int            # tensor bytes of the manifest's samples (what a trainer reads)
    shards: int
    duplicates: int       # sample copies in more than one shard, left out of the manifest
    left_out: int         # samples in shards but not in keep_keys
    exports: dict[str, ExportSummary] = field(default_factory=dict)


def read_dataset_json(version_dir: Path) -> dict:
    path = Path(version_dir) / DATASET_INFO_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainingSetError(f"{path}: cannot read the dataset metadata: {exc}") from exc
    if data.get("format") != DATASET_FORMAT or data.get("schema_version") != SCHEMA_VERSION:
        raise TrainingSetError(f"{path} is format {data.get('format')!r} schema {data.get('schema_version')!r}, "
                               f"expected {DATASET_FORMAT!r} schema {SCHEMA_VERSION}")
    return data


def read_dataset_info(version_dir: Path) -> DatasetInfo:
    data = read_dataset_json(version_dir)
    return DatasetInfo(**{name: data[name] for name in DatasetInfo.__dataclass_fields__})


def read_manifest(version_dir: Path) -> pl.DataFrame:
    path = Path(version_dir) / MANIFEST_NAME
    try:
        return pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise TrainingSetError(f"{path}: cannot read the manifest: {exc}") from exc


def sample_bytes(num_tokens: int, info: DatasetInfo) -> int:
    """Tensor bytes of a sample of ``num_tokens`` tokens: ids and mask (int64) plus aux and final states."""
    width = (len(info.layer_ids) + 1) * info.hidden_size
    return num_tokens * (16 + width * info.torch_dtype.itemsize)


# --------------------------------------------------------------------------- consolidation


def consolidate(version_dir: Path, info: DatasetInfo, keep_keys: set[str] | None = None,
                exports: Sequence[str] = ("specforge",), index_rows: list[dict] | None = None) -> ConsolidationSummary:
    """Build the manifest and dataset.json from the version's shards, then the trainer exports.

    ``keep_keys``: the samples of the dataset (None: every sample in the shards); samples in
    shards but not in it are left out of the manifest and the exports, their shards untouched.
    Each export is checked against ``info`` before anything is written. ``index_rows``: the
    shards' index rows (``read_shard_index``) when the shards are elsewhere (on a GPU node,
    ``--shards-on node``); the manifest is built from them and no export can be made.
    """
    from tasks.exports import (  # exports derive from this module
        check_exports,
        run_export,
    )

    version_dir = Path(version_dir)
    check_exports(exports, info)
    if index_rows is not None and exports:
        raise TrainingSetError(f"{version_dir}: exports {list(exports)} need the shards here; fetch them first")
    rows = index_rows
    if rows is None:
        rows = []
        for shard in list_shards(version_dir):
            _check_layout(shard, info)
            rows.extend(read_shard_index(shard))
    found = pl.DataFrame(rows, schema=MANIFEST_SCHEMA)
    unique = found.unique(subset="sample_key", keep="first", maintain_order=True)  # shards are in name order
    if keep_keys is None:
        manifest = unique
    else:
        manifest = unique.filter(pl.col("sample_key").is_in(list(keep_keys)))
        missing = set(keep_keys) - set(manifest["sample_key"].to_list())
        if missing:
            raise MissingSamples(f"{version_dir}: {len(missing)} of the {len(keep_keys)} samples to keep are in no "
                                 f"shard, e.g. {sorted(missing)[:3]}")
    manifest = manifest.sort("sample_key")
    tokens = int(manifest["num_tokens"].sum())
    supervised = int(manifest["num_supervised"].sum())
    summary = ConsolidationSummary(
        version_dir=str(version_dir), samples=manifest.height, tokens=tokens, supervised_tokens=supervised,
        bytes=sample_bytes(tokens, info), shards=manifest["shard"].n_unique(),
        duplicates=found.height - unique.height, left_out=unique.height - manifest.height)

    _atomic_write(version_dir / MANIFEST_NAME, manifest.write_parquet)
    dataset = {"format": DATASET_FORMAT, "schema_version": SCHEMA_VERSION, **asdict(info),
               "samples": summary.samples, "tokens": tokens, "supervised_tokens": supervised,
               "bytes": summary.bytes, "shards": sorted(set(manifest["shard"].to_list())),
               "exports": list(exports)}
    _atomic_write(version_dir / DATASET_INFO_NAME,
                  lambda p: Path(p).write_text(json.dumps(dataset, indent=2) + "\n"))
    done = {name: run_export(name, version_dir) for name in exports}
    return ConsolidationSummary(**{**asdict(summary), "exports": done})


def _check_layout(shard: Path, info: DatasetInfo) -> None:
    layout = read_shard_layout(shard)
    want = {"dtype": info.dtype, "hidden_size": info.hidden_size,
            "aux_width": len(info.layer_ids) * info.hidden_size}
    if layout != want:
        raise SchemaMismatch(f"shard {shard} holds {layout}; dataset version {info.fingerprint} expects {want}")


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path``: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- loader


class TrainingSetDataset(torch.utils.data.Dataset):
    """A consolidated dataset version, one sample per item, read through the manifest.

    Only the manifest is read up front; a sample's rows are sliced out of its memory-mapped
    shard on access. Items: input_ids, loss_mask (int64 [T]), aux_hidden_states [T, k*H],
    hidden_states [T, H] (post-norm final). Safe to hand to DataLoader workers: open shard
    handles are not pickled.
    """

    def __init__(self, version_dir: Path | str, open_shards: int = 64):
        self.version_dir = Path(version_dir)
        self.info = read_dataset_info(self.version_dir)
        self.manifest = read_manifest(self.version_dir)
        self._shard = self.manifest["shard"].to_list()
        self._start = self.manifest["offset_start"].to_list()
        self._end = self.manifest["offset_end"].to_list()
        self._open_shards = open_shards
        self._handles: OrderedDict[str, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._shard)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} samples of {self.version_dir}")
        name, start, end = self._shard[index], self._start[index], self._end[index]
        f = self._handle(name)
        try:
            return {"input_ids": f.get_slice("input_ids")[start:end],
                    "loss_mask": f.get_slice("loss_mask")[start:end],
                    "aux_hidden_states": f.get_slice("aux_hidden_states")[start:end],
                    "hidden_states": f.get_slice("final_hidden_states")[start:end]}
        except SafetensorError as exc:
            raise ShardCorrupt(f"shard {self.version_dir / 'shards' / name}: cannot read rows [{start}, {end}) "
                               f"of sample {self.manifest['sample_key'][index]}: {exc}") from exc

    def _handle(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            path = self.version_dir / "shards" / name
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ShardCorrupt(f"shard {path} of the manifest cannot be opened: {exc}") from exc
            self._handles[name] = handle
            if len(self._handles) > self._open_shards:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(name)
        return handle

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_handles": OrderedDict()}
