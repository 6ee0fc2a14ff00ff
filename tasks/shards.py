"""The training shard file: one per extraction batch, written once. One module, one spec.

Needs torch and safetensors only: the extraction core writes shards on a GPU node.

Shard (a plain safetensors file; any safetensors reader opens it). Tensors, the samples
concatenated along the token axis in header order::

    input_ids            int64 [N]        N = sum of the samples' token counts
    loss_mask            int64 [N]        0/1, 1 = the draft is trained to predict this token
    offsets              int64 [n+1]      sample i is rows offsets[i]:offsets[i+1]
    aux_hidden_states    store [N, k*H]   residual stream entering the k aux layers, concatenated
    final_hidden_states  store [N, H]     last layer's output AFTER the model's final norm
    prenorm_hidden_states store [N, H]    the same BEFORE the final norm (speculators' trainer norms it)
    aux_scales           float32 [N, k]   only when store is float8_e4m3fn, see below
    final_scales         float32 [N, 1]   idem
    prenorm_scales       float32 [N, 1]   idem

Metadata (string header): ``format == "eagle3-training-shard"``, ``version`` (SCHEMA_VERSION),
``dtype`` (the hidden states' dtype as extracted), ``store_dtype`` (as stored: ``dtype``, or
``float8_e4m3fn``), ``hidden_size``, ``aux_width`` (k*H), and ``samples``: a JSON list, in
offset order, of ``{"sample_key", "source_id", "num_supervised", "content_hash"}``.
``content_hash`` covers the dtype, shapes and bytes of the sample's stored tensors (ids,
mask, aux, final, pre-norm final, then the scales when quantized): the exports use it to tell an up-to-date
file from a stale one without reading it.

float8_e4m3fn storage (``write_shard(..., store_dtype="float8_e4m3fn")``), per-token scales as
speculators' FP8 backend (PR #1028) but one scale per aux layer: each token's H values of one
layer are divided by ``scale = max|value| / 448`` (448: e4m3fn's largest finite value) and
rounded to float8; ``value ~= float8 * scale`` (``dequantize_per_token``). Half the bytes of
bf16; the reconstruction error is in the README.

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
from concurrent.futures import ThreadPoolExecutor
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
#: quantized storage dtypes (per-token scales); the loader hands out the extracted dtype again
QUANTIZED_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn}


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


def content_hash(*tensors: torch.Tensor) -> str:
    """sha256 (32 hex chars) over each tensor's dtype, shape and bytes, in the order given."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(byte_view(t))
    return h.hexdigest()[:32]


def write_shard(path: Path, samples: list[TrainingSample], store_dtype: str | None = None) -> ShardSummary:
    """Write the samples as one shard, atomically. Returns what the shard holds.

    The file is streamed tensor by tensor from the samples' own memory, so a batch's
    hidden states are never held twice (torch.cat or safetensors' save would copy them).
    ``store_dtype``: None stores the samples' dtype; "float8_e4m3fn" quantizes (module docstring).
    """
    path = Path(path)
    if not samples:
        raise TrainingSetError(f"shard {path}: no samples to write")
    dtype, hidden, aux_width = _check_samples(path, samples)
    if store_dtype is not None and store_dtype not in QUANTIZED_DTYPES:
        raise TrainingSetError(f"shard {path}: unknown store dtype {store_dtype!r}; known: {list(QUANTIZED_DTYPES)}")
    lengths = [int(s.input_ids.numel()) for s in samples]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    total = int(offsets[-1])
    stored = [_stored_tensors(s, store_dtype, aux_width // hidden) for s in samples]
    # hashlib releases the GIL: hashing a batch on several cores keeps a shard write short
    # (at H=4096 a batch of 100 is ~3.6 GB; one thread hashes ~1.4 GB/s)
    with ThreadPoolExecutor(max_workers=min(8, len(samples)), thread_name_prefix="shard-hash") as pool:
        hashes = list(pool.map(lambda st: content_hash(st[0].input_ids, st[0].loss_mask, *st[1]), zip(samples, stored)))
    entries = [{"sample_key": s.sample_key, "source_id": s.source_id, "num_supervised": int(s.loss_mask.sum()),
                "content_hash": h} for s, h in zip(samples, hashes)]
    store = dtype if store_dtype is None else QUANTIZED_DTYPES[store_dtype]
    metadata = {"format": SHARD_FORMAT, "version": str(SCHEMA_VERSION), "dtype": _dtype_name(dtype),
                "store_dtype": _dtype_name(store), "hidden_size": str(hidden), "aux_width": str(aux_width),
                "samples": json.dumps(entries)}
    columns = [  # (name, dtype, shape, parts): parts are written back to back
        ("input_ids", torch.int64, [total], [s.input_ids for s in samples]),
        ("loss_mask", torch.int64, [total], [s.loss_mask for s in samples]),
        ("offsets", torch.int64, [len(samples) + 1], [offsets]),
        ("aux_hidden_states", store, [total, aux_width], [t[0] for t in stored]),
        ("final_hidden_states", store, [total, hidden], [t[1] for t in stored]),
        ("prenorm_hidden_states", store, [total, hidden], [t[2] for t in stored]),
    ]
    if store_dtype is not None:
        columns += [("aux_scales", torch.float32, [total, aux_width // hidden], [t[3] for t in stored]),
                    ("final_scales", torch.float32, [total, 1], [t[4] for t in stored]),
                    ("prenorm_scales", torch.float32, [total, 1], [t[5] for t in stored])]
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
    """The shard's dtype, store_dtype, hidden_size and aux_width, from its header."""
    path = Path(path)
    meta, _ = _read_header(path)
    try:
        return {"dtype": meta["dtype"], "store_dtype": meta["store_dtype"], "hidden_size": int(meta["hidden_size"]),
                "aux_width": int(meta["aux_width"])}
    except (KeyError, ValueError) as exc:
        raise ShardCorrupt(f"shard {path}: no dtype/store_dtype/hidden_size/aux_width in its header: {exc}") from exc


def quantize_per_token(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups*H] -> (float8_e4m3fn [T, groups*H], float32 scales [T, groups]); see the module docstring."""
    rows = x.detach().float().reshape(x.shape[0], groups, -1)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scales = (rows.abs().amax(-1) / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero row stays 0
    return (rows / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape), scales


def dequantize_per_token(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_per_token, in ``dtype``."""
    rows = q.float().reshape(q.shape[0], scales.shape[1], -1) * scales.unsqueeze(-1)
    return rows.reshape(q.shape).to(dtype)


def _stored_tensors(s: TrainingSample, store_dtype: str | None, layers: int) -> tuple[torch.Tensor, ...]:
    """(aux, final, prenorm) as they are, or quantized: the same, then their scales."""
    if store_dtype is None:
        return s.aux_hidden_states, s.final_hidden_states, s.prenorm_hidden_states
    aux, aux_scales = quantize_per_token(s.aux_hidden_states, layers)
    final, final_scales = quantize_per_token(s.final_hidden_states, 1)
    prenorm, prenorm_scales = quantize_per_token(s.prenorm_hidden_states, 1)
    return aux, final, prenorm, aux_scales, final_scales, prenorm_scales


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
        if (s.final_hidden_states.shape != (t, hidden) or s.prenorm_hidden_states.shape != (t, hidden)
                or s.aux_hidden_states.shape != (t, aux_width)):
            raise bad(f"hidden states aux {tuple(s.aux_hidden_states.shape)} final {tuple(s.final_hidden_states.shape)}"
                      f" pre-norm {tuple(s.prenorm_hidden_states.shape)} do not fit [{t}, {aux_width}] and "
                      f"[{t}, {hidden}] (shapes of the shard's first sample)")
        states = (s.aux_hidden_states, s.final_hidden_states, s.prenorm_hidden_states)
        if any(x.dtype != dtype for x in states):
            raise bad(f"hidden states of dtypes {'/'.join(str(x.dtype) for x in states)}, the shard's are {dtype}")
    return dtype, hidden, aux_width


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
