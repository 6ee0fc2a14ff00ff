"""The training-set layout: shards, manifest, dataset metadata and the loader. One module, one spec.

A dataset version folder (``{out}/versions/{fingerprint}/``, see tasks.dataset_version) holds::

    shards/{name}.safetensors   one per extraction batch, written once, never modified
    manifest.parquet            one row per sample of the dataset (what a trainer reads)
    dataset.json                DatasetInfo, counts, schema version, and what else is on disk
    vocab_mapping.pt            SpecForge's draft vocabulary mapping (tasks.vocab_mapping)
    token_freq.pt               speculators' supervised token frequencies (tasks.vocab_mapping)
    exports/{trainer}/          the same samples in a trainer's own format (tasks.exports)

dataset.json is written last by each step that adds files (tasks.consolidation, the export
command): it names only what is on disk and matches the manifest. ``exports`` lists the
export folders that do (any other folder under exports/ is from an earlier manifest);
``vocab_mapping`` says the draft and target vocabulary sizes, the share of supervised tokens
the draft vocabulary covers, and the files' names. ``store_dtype`` says how the shards store
the hidden states (tasks.shards).

Shards: tasks.shards.

``{out}/latest`` is a relative symlink (``versions/{fingerprint}``) to the version of the last run
that completed (``point_latest``). It is moved by renaming a new link over the old one, so a reader
finds the old version or the new one, never neither, and it is moved only once a run has
consolidated its version and completed. A symlink rather than a pointer file: every reader,
this project's or a trainer's, takes a folder path and follows it unchanged. Readers that keep
a version open resolve the link once (``TrainingSetDataset``, the exports), so a run that moves
it meanwhile does not switch their version under them.

Manifest columns: sample_key, source_id, num_tokens, num_supervised, shard (file name under
shards/), offset_start, offset_end (token rows in that shard), content_hash; sorted by sample_key.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl
import torch
from safetensors import SafetensorError, safe_open

from tasks.dataset_version import SCHEMA_VERSION
from tasks.shards import HIDDEN_DTYPES, QUANTIZED_DTYPES, ShardCorrupt, TrainingSetError, dequantize_per_token

DATASET_FORMAT = "eagle3-training-set"
MANIFEST_NAME = "manifest.parquet"
DATASET_INFO_NAME = "dataset.json"
LATEST_NAME = "latest"

MANIFEST_SCHEMA = {
    "sample_key": pl.String, "source_id": pl.String, "num_tokens": pl.Int64, "num_supervised": pl.Int64,
    "shard": pl.String, "offset_start": pl.Int64, "offset_end": pl.Int64, "content_hash": pl.String,
}


# --------------------------------------------------------------------------- dataset metadata


@dataclass(frozen=True)
class DatasetInfo:
    model: str
    layer_ids: list[int]
    layer_convention: str   # patches.dumps.LAYER_CONVENTION: ids index HF hidden_states (input of layer i)
    final_states: str       # patches.dumps.FINAL_STATES: the post-norm and the pre-norm final state
    dtype: str              # the hidden states' dtype as extracted, and as the loader hands them out
    store_dtype: str        # as the shards store them: dtype, or float8_e4m3fn with per-token scales
    hidden_size: int
    num_layers: int
    vocab_size: int         # the target's vocabulary (lm_head rows): the draft vocabulary mapping's range
    template_hash: str
    max_length: int
    project_version: str
    fingerprint: str
    #: the chat template's variables (date, enable_thinking, chat_template_kwargs): tasks.chat_template
    template_variables: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return HIDDEN_DTYPES[self.dtype]


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
    missing = [name for name in DatasetInfo.__dataclass_fields__ if name not in data]
    if missing:
        raise TrainingSetError(f"{Path(version_dir) / DATASET_INFO_NAME} lacks {missing}; consolidate the version "
                               f"again (python -m flows.extract with the same parameters) to rewrite it")
    return DatasetInfo(**{name: data[name] for name in DatasetInfo.__dataclass_fields__})


def write_dataset_json(version_dir: Path, data: dict) -> None:
    """Replace dataset.json atomically; callers write it after the files it names."""
    data = {"format": DATASET_FORMAT, "schema_version": SCHEMA_VERSION, **data}
    atomic_write(Path(version_dir) / DATASET_INFO_NAME,
                 lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def read_manifest(version_dir: Path) -> pl.DataFrame:
    path = Path(version_dir) / MANIFEST_NAME
    try:
        return pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise TrainingSetError(f"{path}: cannot read the manifest: {exc}") from exc


def sample_bytes(num_tokens: int, info: DatasetInfo) -> int:
    """Tensor bytes of a sample of ``num_tokens`` tokens: ids and mask (int64) plus aux and both final states."""
    width = (len(info.layer_ids) + 2) * info.hidden_size
    return num_tokens * (16 + width * info.torch_dtype.itemsize)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp_path)`` then rename over ``path``: readers see the old file or the new one, whole.

    The temporary name is dot-named and ends in .tmp, which neither our readers nor any
    trainer's reader collects.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def point_latest(out: Path, version_dir: Path) -> Path:
    """Point ``{out}/latest`` at ``version_dir`` in one rename; returns the link."""
    link = Path(out) / LATEST_NAME
    if link.exists() and not link.is_symlink():
        raise TrainingSetError(f"{link} is not the latest-version symlink this tool keeps; move it away")
    target = os.path.relpath(version_dir, out)  # relative: the output folder can be moved or copied whole
    atomic_write(link, lambda tmp: os.symlink(target, tmp))
    return link


# --------------------------------------------------------------------------- loader


class TrainingSetDataset(torch.utils.data.Dataset):
    """A consolidated dataset version, one sample per item, read through the manifest.

    Only the manifest is read up front; a sample's rows are sliced out of its memory-mapped
    shard on access. Items: input_ids, loss_mask (int64 [T]), aux_hidden_states [T, k*H],
    hidden_states [T, H] (the final state after the model's final norm), prenorm_hidden_states
    [T, H] (the same before the norm), in ``info.dtype`` (float8 shards are dequantized).
    Safe to hand to DataLoader workers: open shard handles are not pickled.
    """

    def __init__(self, version_dir: Path | str, open_shards: int = 64):
        # Resolved once: given {out}/latest, the version stays the one read here when a run moves the link.
        self.version_dir = Path(version_dir).resolve()
        self.info = read_dataset_info(self.version_dir)
        self.manifest = read_manifest(self.version_dir)
        self._shard = self.manifest["shard"].to_list()
        self._start = self.manifest["offset_start"].to_list()
        self._end = self.manifest["offset_end"].to_list()
        self._open_shards = open_shards
        self._quantized = self.info.store_dtype in QUANTIZED_DTYPES
        self._handles: OrderedDict[str, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._shard)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} samples of {self.version_dir}")
        name, start, end = self._shard[index], self._start[index], self._end[index]
        f = self._handle(name)
        try:
            # A slice of a memory-mapped shard shares the storage of the whole shard tensor;
            # torch.save and the pickling to DataLoader workers would carry all of it. A
            # clone holds exactly the sample's rows.
            item = {"input_ids": f.get_slice("input_ids")[start:end].clone(),
                    "loss_mask": f.get_slice("loss_mask")[start:end].clone()}
            for name, column in (("aux_hidden_states", "aux"), ("hidden_states", "final"),
                                 ("prenorm_hidden_states", "prenorm")):
                stored = f.get_slice(f"{column}_hidden_states")[start:end]
                item[name] = dequantize_per_token(stored, f.get_slice(f"{column}_scales")[start:end],
                                                  self.info.torch_dtype) if self._quantized else stored.clone()
            return item
        except SafetensorError as exc:
            raise ShardCorrupt(f"shard {self.version_dir / 'shards' / name}: cannot read rows [{start}, {end}) "
                               f"of sample {self.manifest['sample_key'][index]}: {exc}") from exc

    def tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sample's input_ids and loss_mask alone (no hidden state is read)."""
        name, start, end = self._shard[index], self._start[index], self._end[index]
        f = self._handle(name)
        try:
            return f.get_slice("input_ids")[start:end].clone(), f.get_slice("loss_mask")[start:end].clone()
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
