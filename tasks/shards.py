"""The training shard file: one per extraction batch, written once. One module, one spec.

Needs torch and safetensors only: the extraction core writes shards on a GPU node.

Shard (a plain safetensors file; any safetensors reader opens it). Tensors, the samples
concatenated along the token axis in header order::

    input_ids            int64 [N]        N = sum of the samples' token counts
    loss_mask            int64 [N]        0/1, 1 = the draft is trained to predict this token
    offsets              int64 [n+1]      sample i is rows offsets[i]:offsets[i+1]
    aux_hidden_states    dtype [N, k*H]   residual stream entering the k aux layers, concatenated
    final_hidden_states  dtype [N, H]     last layer's output AFTER the model's final norm

Metadata (string header): ``format == "eagle3-training-shard"``, ``version`` (SCHEMA_VERSION),
``dtype``, ``hidden_size``, ``aux_width`` (k*H), and ``samples``: a JSON list, in offset order,
of ``{"sample_key", "source_id", "num_supervised", "content_hash"}``. ``content_hash`` covers
the dtype, shapes and bytes of the sample's four tensors: the exports use it to tell an
up-to-date file from a stale one without reading it.

Shards appear atomically (a dot-named ``.tmp`` file in the same folder, then a rename), so a
crash leaves either the whole shard or none. A sample key may sit in several shards (a rerun
after a crash between the shard write and the manifest); consolidation keeps the copy in the
first shard by name, so the choice does not change between reruns.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from patches.safetensors_stream import byte_view, write_safetensors
from tasks.dataset_version import SCHEMA_VERSION
from tasks.samples import TrainingSample

SHARD_FORMAT = "eagle3-training-shard"
SHARD_SUFFIX = ".safetensors"

HIDDEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- errors


class TrainingSetError(Exception):
    """A training set or one of its files cannot be written or used; the message names the path."""


class InvalidSample(TrainingSetError):
    """A sample handed to write_shard has wrong shapes, dtypes or mask values."""

    def __init__(self, sample_key: str, path: Path | str, reason: str):
        self.sample_key, self.path, self.reason = sample_key, str(path), reason
        super().__init__(f"sample {sample_key!r} for shard {path}: {reason}")


class ShardCorrupt(TrainingSetError):
    """A shard file cannot be parsed or is not a training shard of this schema version."""


# --------------------------------------------------------------------------- samples and shards


@dataclass(frozen=True)
class ShardSummary:
    path: str
    samples: int
    tokens: int
    bytes: int
    sample_keys: list[str]


def content_hash(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> str:
    """sha256 (32 hex chars) over each tensor's dtype, shape and bytes, in this order."""
    h = hashlib.sha256()
    for t in (input_ids, loss_mask, aux, final):
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(byte_view(t))
    return h.hexdigest()[:32]


def write_shard(path: Path, samples: list[TrainingSample]) -> ShardSummary:
    """Write the samples as one shard, atomically. Returns what the shard holds.

    The file is streamed tensor by tensor from the samples' own memory, so a batch's
    hidden states are never held twice (torch.cat or safetensors' save would copy them).
    """
    path = Path(path)
    if not samples:
        raise TrainingSetError(f"shard {path}: no samples to write")
    dtype, hidden, aux_width = _check_samples(path, samples)
    lengths = [int(s.input_ids.numel()) for s in samples]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    total = int(offsets[-1])
    entries = [{"sample_key": s.sample_key, "source_id": s.source_id, "num_supervised": int(s.loss_mask.sum()),
                "content_hash": content_hash(s.input_ids, s.loss_mask, s.aux_hidden_states, s.final_hidden_states)}
               for s in samples]
    metadata = {"format": SHARD_FORMAT, "version": str(SCHEMA_VERSION), "dtype": _dtype_name(dtype),
                "hidden_size": str(hidden), "aux_width": str(aux_width), "samples": json.dumps(entries)}
    columns = [  # (name, dtype, shape, parts): parts are written back to back
        ("input_ids", torch.int64, [total], [s.input_ids for s in samples]),
        ("loss_mask", torch.int64, [total], [s.loss_mask for s in samples]),
        ("offsets", torch.int64, [len(samples) + 1], [offsets]),
        ("aux_hidden_states", dtype, [total, aux_width], [s.aux_hidden_states for s in samples]),
        ("final_hidden_states", dtype, [total, hidden], [s.final_hidden_states for s in samples]),
    ]
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write_safetensors(f, columns, metadata)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ShardSummary(str(path), len(samples), total, path.stat().st_size, [s.sample_key for s in samples])


def read_shard_index(path: Path | str) -> list[dict]:
    """The shard's samples from its header and offsets alone (no hidden state is read).

    Each row: sample_key, source_id, num_tokens, num_supervised, shard (file name),
    offset_start, offset_end, content_hash -- the manifest's columns.
    """
    path = Path(path)
    meta, offsets = _read_header(path)
    try:
        entries = json.loads(meta["samples"])
        rows = [{"sample_key": e["sample_key"], "source_id": e["source_id"], "num_tokens": end - start,
                 "num_supervised": e["num_supervised"], "shard": path.name, "offset_start": start,
                 "offset_end": end, "content_hash": e["content_hash"]}
                for e, start, end in zip(entries, offsets[:-1], offsets[1:])]
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardCorrupt(f"shard {path}: unreadable sample list in its header: {type(exc).__name__}: {exc}") from exc
    if len(offsets) != len(entries) + 1:
        raise ShardCorrupt(f"shard {path}: {len(entries)} samples in the header but {len(offsets) - 1} in offsets")
    return rows


def read_shard_layout(path: Path | str) -> dict:
    """The shard's dtype, hidden_size and aux_width, from its header."""
    path = Path(path)
    meta, _ = _read_header(path)
    try:
        return {"dtype": meta["dtype"], "hidden_size": int(meta["hidden_size"]), "aux_width": int(meta["aux_width"])}
    except (KeyError, ValueError) as exc:
        raise ShardCorrupt(f"shard {path}: no dtype/hidden_size/aux_width in its header: {exc}") from exc


def _read_header(path: Path) -> tuple[dict, list[int]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != SHARD_FORMAT or meta.get("version") != str(SCHEMA_VERSION):
                raise ShardCorrupt(f"shard {path} is format {meta.get('format')!r} version {meta.get('version')!r}, "
                                   f"expected {SHARD_FORMAT!r} version {SCHEMA_VERSION}")
            return meta, f.get_tensor("offsets").tolist()
    except (SafetensorError, OSError) as exc:
        raise ShardCorrupt(f"shard {path}: cannot read its header: {type(exc).__name__}: {exc}") from exc


def list_shards(version_dir: Path) -> list[Path]:
    """Finished shards by name (temporary files of unfinished writes are dot-named .tmp files)."""
    folder = Path(version_dir) / "shards"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(SHARD_SUFFIX) and not p.name.startswith("."))


def _check_samples(path: Path, samples: list[TrainingSample]) -> tuple[torch.dtype, int, int]:
    first = samples[0]
    dtype = first.final_hidden_states.dtype
    if dtype not in HIDDEN_DTYPES.values():
        raise InvalidSample(first.sample_key, path, f"hidden states of dtype {dtype}; supported: {list(HIDDEN_DTYPES)}")
    hidden = first.final_hidden_states.shape[-1]
    aux_width = first.aux_hidden_states.shape[-1]
    if aux_width % hidden:
        raise InvalidSample(first.sample_key, path, f"aux width {aux_width} is not a multiple of hidden size {hidden}")
    seen: set[str] = set()
    for s in samples:
        def bad(reason: str) -> InvalidSample:
            return InvalidSample(s.sample_key, path, reason)
        if s.sample_key in seen:
            raise bad("appears twice in one shard")
        seen.add(s.sample_key)
        t = s.input_ids.numel()
        if t == 0 or s.input_ids.shape != (t,) or s.input_ids.dtype != torch.int64:
            raise bad(f"input_ids must be int64 [T>0], got {s.input_ids.dtype} {tuple(s.input_ids.shape)}")
        if s.loss_mask.shape != (t,) or s.loss_mask.dtype != torch.int64:
            raise bad(f"loss_mask must be int64 [{t}], got {s.loss_mask.dtype} {tuple(s.loss_mask.shape)}")
        if not bool(((s.loss_mask == 0) | (s.loss_mask == 1)).all()):
            raise bad("loss_mask holds values other than 0 and 1")
        if s.final_hidden_states.shape != (t, hidden) or s.aux_hidden_states.shape != (t, aux_width):
            raise bad(f"hidden states aux {tuple(s.aux_hidden_states.shape)} final {tuple(s.final_hidden_states.shape)}"
                      f" do not fit [{t}, {aux_width}] and [{t}, {hidden}] (shapes of the shard's first sample)")
        if s.aux_hidden_states.dtype != dtype or s.final_hidden_states.dtype != dtype:
            raise bad(f"hidden states of dtypes {s.aux_hidden_states.dtype}/{s.final_hidden_states.dtype}, "
                      f"the shard's are {dtype}")
    return dtype, hidden, aux_width


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
