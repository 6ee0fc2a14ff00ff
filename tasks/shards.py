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

A batch's samples stream into its shard as they are verified (:class:`ShardWriter`; the
layout is planned from the batch, so each sample's rows go to their place at once), so the
extracting client never holds a batch. Shards appear atomically (a dot-named ``.tmp`` file in
the same folder, then a rename), so a crash leaves either the whole shard or none. A sample key may sit in several shards (a rerun
after a crash between the shard write and the manifest); consolidation keeps the copy in the
first shard by name, so the choice does not change between reruns.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from patches.safetensors_stream import SAFETENSORS_DTYPES, byte_view
from tasks.dataset_version import SCHEMA_VERSION
from tasks.samples import PreparedSample, TrainingSample

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

    def __reduce__(self):  # raised in a reader process, re-raised in this one
        return type(self), (self.sample_key, self.path, self.reason)


class ShardWriteFailed(OSError):
    """A shard could not be written (a full disk...): the message names its path."""


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
    """xxh3-128 (32 hex chars) over each tensor's dtype, shape and bytes, in the order given.

    It tells an up-to-date export file from a stale one, with no adversary to resist, so a
    fast non-cryptographic hash: xxh3 hashes ~15 GB/s a thread where sha256 did 1.1, and the
    shard writer hashes every byte a GPU node extracts (xxhash comes with SGLang).
    """
    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(byte_view(t))
    return h.hexdigest()


@dataclass(frozen=True)
class _Planned:
    sample_key: str
    source_id: str
    tokens: int
    num_supervised: int


class ShardWriter:
    """One shard, written as its samples arrive: from many threads, in any order.

    The samples the shard is planned for are known up front (keys, token counts, masks), so
    the file's layout is too: each sample's rows go straight to their place in every column
    (through a mapping, from the sample's own memory), and the sample can be dropped at once. A
    batch's hidden states are never held together: the client's memory is bounded by what
    is in flight, not by the batch size. The file gets its whole size at the start, sparse,
    and the free space is checked then: a full disk fails the batch before its samples are
    extracted. Each sample's rows are reserved (``posix_fallocate``) right before they are
    written, by the reader that writes them, so a disk that fills up meanwhile fails that
    write with ENOSPC instead of a mapping hitting a hole. Not the whole file at the start:
    on tmpfs that zeroes every page first (0.84 s for a 4.3 GB shard on the H200 node), and
    the batch sent nothing meanwhile.

    ``close`` writes the header and renames the file into place, atomically. When planned
    samples never arrived (they failed), the shard is compacted first: the present samples'
    rows are copied into a new file by the kernel (``copy_file_range``), in plan order. A
    shard's layout is the plan's order whatever the arrival order, so reruns give the same
    file. Nothing added: no file, ``close`` returns None.
    """

    def __init__(self, path: Path | str, plan: Sequence[PreparedSample | TrainingSample], dtype: torch.dtype,
                 hidden_size: int, num_taps: int, store_dtype: str | None = None):
        self.path = Path(path)
        if store_dtype is not None and store_dtype not in QUANTIZED_DTYPES:
            raise TrainingSetError(f"shard {self.path}: unknown store dtype {store_dtype!r}; "
                                   f"known: {list(QUANTIZED_DTYPES)}")
        if dtype not in HIDDEN_DTYPES.values():
            raise TrainingSetError(f"shard {self.path}: hidden states of dtype {dtype}; "
                                   f"supported: {list(HIDDEN_DTYPES)}")
        self.dtype, self.hidden, self.num_taps, self.store_dtype = dtype, hidden_size, num_taps, store_dtype
        self._plan: dict[str, tuple[int, _Planned]] = {}
        for s in plan:
            if s.sample_key in self._plan:
                raise InvalidSample(s.sample_key, self.path, "appears twice in one shard")
            planned = _Planned(s.sample_key, s.source_id, len(s.input_ids), int(torch.as_tensor(s.loss_mask).sum()))
            self._plan[s.sample_key] = (len(self._plan), planned)
        if not self._plan:
            raise TrainingSetError(f"shard {self.path}: no samples planned")
        self._hashes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        self._layout = _Layout(self, [p for _, p in self._plan.values()])
        free = _free_bytes(self.path.parent)
        if free < self._layout.size:
            raise ShardWriteFailed(errno.ENOSPC, f"cannot write shard {self.path}: {os.strerror(errno.ENOSPC)} "
                                                 f"({self._layout.size} bytes needed, {free} free)")
        self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(self._fd, self._layout.size)
        except OSError as exc:
            self.abort()
            raise ShardWriteFailed(exc.errno, f"cannot write shard {self.path}: {exc.strerror} (sizing it to "
                                              f"{self._layout.size} bytes)") from exc

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, sample: TrainingSample) -> None:
        """Write one planned sample's rows in place (thread-safe; any order)."""
        slot = self.claim(sample.sample_key)
        try:
            digest = slot.write(sample)
        except BaseException:
            self.release(sample.sample_key)
            raise
        self.filled(sample.sample_key, digest)

    def claim(self, sample_key: str) -> "ShardSlot":
        """The place of a planned sample's rows, for one writer (this process or another):
        ``filled`` with the digest ``ShardSlot.write`` returns, or ``release``d when it failed."""
        index_planned = self._plan.get(sample_key)
        if index_planned is None:
            raise InvalidSample(sample_key, self.path, "was not planned for this shard")
        index, planned = index_planned
        with self._lock:
            if sample_key in self._hashes:
                raise InvalidSample(sample_key, self.path, "added twice")
            self._hashes[sample_key] = ""  # claimed; its rows are being written
        return ShardSlot(str(self.path), str(self._tmp), tuple(self._layout.sample_ranges(index)), planned,
                         self.dtype, self.hidden, self.num_taps, self.store_dtype)

    def filled(self, sample_key: str, digest: str) -> None:
        with self._lock:
            self._hashes[sample_key] = digest

    def release(self, sample_key: str) -> None:
        with self._lock:
            self._hashes.pop(sample_key, None)

    def close(self) -> ShardSummary | None:
        """Header, compaction if samples are missing, fsync, rename into place."""
        try:
            present = [p for _, p in self._plan.values() if self._hashes.get(p.sample_key)]
            if not present:
                self.abort()
                return None
            fd, tmp, layout = self._fd, self._tmp, self._layout
            if len(present) < len(self._plan):
                fd, tmp, layout = self._compacted(present)
            header = layout.header([self._hashes[p.sample_key] for p in present])
            _pwrite_all(fd, header, 0, self.path)
            offsets = torch.tensor([0] + [p.tokens for p in present], dtype=torch.int64).cumsum(0)
            _pwrite_all(fd, byte_view(offsets), layout.column_start["offsets"], self.path)
            os.fsync(fd)
            if fd != self._fd:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = -1
        if tmp != self._tmp:
            self._tmp.unlink(missing_ok=True)
        return ShardSummary(str(self.path), len(present), layout.tokens, self.path.stat().st_size,
                            [p.sample_key for p in present])

    def abort(self) -> None:
        """Drop the temporary file (a failed batch leaves nothing behind)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)

    def _compacted(self, present: list[_Planned]) -> tuple[int, Path, _Layout]:
        """A second temporary file holding only ``present``'s rows (the others failed), and its layout."""
        full = self._layout
        index = {p.sample_key: i for i, p in enumerate(full.samples)}
        small = _Layout(self, present)
        tmp = self._tmp.with_name(self._tmp.name.removesuffix(".tmp") + "-compact.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, small.size)
            except OSError as exc:
                raise ShardWriteFailed(exc.errno, f"cannot write shard {self.path}: {exc.strerror} (compacting)") from exc
            for new_index, p in enumerate(present):
                for (src, length), (dst, _) in zip(full.sample_ranges(index[p.sample_key]),
                                                   small.sample_ranges(new_index)):
                    _copy_range(self._fd, src, fd, dst, length, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return fd, tmp, small


@dataclass(frozen=True)
class ShardSlot:
    """Where one planned sample's rows go in a shard being written: plain data, so that a reader
    process writes them (into the shard's temporary file, see :func:`_copy_into_file`) and only
    the digest travels back."""

    shard: str
    tmp: str
    #: (file offset, bytes) per per-token column, in column order
    ranges: tuple[tuple[int, int], ...]
    planned: _Planned
    dtype: torch.dtype
    hidden: int
    num_taps: int
    store_dtype: str | None

    def write(self, sample: TrainingSample) -> str:
        """Check the sample against the plan, write its rows; returns its content hash."""
        shard = Path(self.shard)
        _check_sample(shard, sample, self.planned, self.dtype, self.hidden, self.hidden * self.num_taps)
        parts = (sample.input_ids, sample.loss_mask, *_stored_tensors(sample, self.store_dtype, self.num_taps))
        digest = content_hash(*parts)
        try:
            fd = os.open(self.tmp, os.O_RDWR)  # a shared mapping needs read access too
        except OSError as exc:
            raise ShardWriteFailed(exc.errno, f"cannot write shard {shard}: {exc.strerror} (opening {self.tmp})") from exc
        try:
            for (position, _), part in zip(self.ranges, parts):
                _copy_into_file(fd, byte_view(part), position, shard)
        finally:
            os.close(fd)
        return digest


class _Layout:
    """Where every column, and every planned sample's rows in it, lie in the shard file."""

    def __init__(self, shard: ShardWriter, samples: list[_Planned]):
        self.samples = samples
        self.tokens = sum(p.tokens for p in samples)
        store = shard.dtype if shard.store_dtype is None else QUANTIZED_DTYPES[shard.store_dtype]
        h, k = shard.hidden, shard.num_taps
        # (name, dtype, shape of one token's row); offsets is the one column that is not per token
        self.columns: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("input_ids", torch.int64, ()), ("loss_mask", torch.int64, ()), ("offsets", torch.int64, ()),
            ("aux_hidden_states", store, (k * h,)), ("final_hidden_states", store, (h,)),
            ("prenorm_hidden_states", store, (h,))]
        if shard.store_dtype is not None:
            self.columns += [("aux_scales", torch.float32, (k,)), ("final_scales", torch.float32, (1,)),
                             ("prenorm_scales", torch.float32, (1,))]
        self.metadata = {"format": SHARD_FORMAT, "version": str(SCHEMA_VERSION), "dtype": _dtype_name(shard.dtype),
                         "store_dtype": _dtype_name(store), "hidden_size": str(h), "aux_width": str(k * h)}
        self.row_bytes = {name: math.prod(row) * dtype.itemsize for name, dtype, row in self.columns}
        # The header's length does not depend on the hashes' values (32 hex chars each).
        self.header_size = len(self.header(["0" * 32] * len(samples)))
        self.column_start, cursor = {}, self.header_size
        for name, _, _ in self.columns:
            self.column_start[name] = cursor
            cursor += self._column_bytes(name)
        self.size = cursor
        first_rows = [0]
        for p in samples:
            first_rows.append(first_rows[-1] + p.tokens)
        self.first_row = first_rows

    def _shape(self, name: str, row: tuple[int, ...]) -> list[int]:
        return [len(self.samples) + 1] if name == "offsets" else [self.tokens, *row]

    def _column_bytes(self, name: str) -> int:
        return (len(self.samples) + 1) * 8 if name == "offsets" else self.tokens * self.row_bytes[name]

    def header(self, hashes: list[str]) -> bytes:
        """The 8-byte length and the JSON header (padded to 8 bytes, as safetensors writes it)."""
        entries = [{"sample_key": p.sample_key, "source_id": p.source_id, "num_supervised": p.num_supervised,
                    "content_hash": h} for p, h in zip(self.samples, hashes)]
        header: dict = {"__metadata__": {**self.metadata, "samples": json.dumps(entries)}}
        cursor = 0
        for name, dtype, row in self.columns:
            size = self._column_bytes(name)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": self._shape(name, row),
                            "data_offsets": [cursor, cursor + size]}
            cursor += size
        data = json.dumps(header, separators=(",", ":")).encode()
        data += b" " * (-(8 + len(data)) % 8)  # data starts 8-byte aligned
        return struct.pack("<Q", len(data)) + data

    def sample_ranges(self, index: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of sample ``index``'s rows in each per-token column, in column order."""
        first, tokens = self.first_row[index], self.samples[index].tokens
        return [(self.column_start[name] + first * self.row_bytes[name], tokens * self.row_bytes[name])
                for name, _, _ in self.columns if name != "offsets"]


def _pwrite_all(fd: int, data, offset: int, path: Path) -> None:
    """All of ``data`` at ``offset``; ``path`` (the shard's) names it in an error."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            raise ShardWriteFailed(exc.errno, f"cannot write shard {path}: {exc.strerror}") from exc
        view, offset = view[n:], offset + n


def _copy_into_file(fd: int, data, offset: int, path: Path) -> None:
    """All of ``data`` at ``offset``, through a shared mapping of that range, reserved first.

    Not ``pwrite``: every write to a file takes its inode lock, so the readers writing one
    shard queued behind each other (16 readers wrote slower than 12 on the H200). Stores into
    a mapping run in parallel. The range is reserved (``posix_fallocate``) before it is
    mapped: a store into a hole on a full disk would kill the process (SIGBUS), a failed
    reservation is an error that names the shard.
    """
    view = memoryview(data).cast("B")
    if not view:  # nothing to map (a zero-length mapping is an error)
        return
    try:
        os.posix_fallocate(fd, offset, len(view))
    except OSError as exc:
        raise ShardWriteFailed(exc.errno, f"cannot write shard {path}: {exc.strerror} (reserving "
                               f"{len(view)} bytes at {offset})") from exc
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, offset - start + len(view), offset=start)
    except OSError as exc:
        raise ShardWriteFailed(exc.errno, f"cannot write shard {path}: {exc.strerror} (mapping "
                               f"{len(view)} bytes at {offset})") from exc
    with mapping, memoryview(mapping) as window:
        window[offset - start:] = view


def _free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, length: int, path: Path) -> None:
    while length:
        try:
            n = os.copy_file_range(src, dst, length, src_offset, dst_offset)
        except OSError as exc:
            raise ShardWriteFailed(exc.errno, f"cannot write shard {path}: {exc.strerror} (compacting)") from exc
        if n == 0:
            raise TrainingSetError(f"compacting shard {path}: the temporary file ended early")
        src_offset, dst_offset, length = src_offset + n, dst_offset + n, length - n


def write_shard(path: Path, samples: list[TrainingSample], store_dtype: str | None = None) -> ShardSummary:
    """Write the samples as one shard, atomically (a :class:`ShardWriter` planned for them)."""
    path = Path(path)
    if not samples:
        raise TrainingSetError(f"shard {path}: no samples to write")
    first = samples[0]
    hidden = first.final_hidden_states.shape[-1]
    aux_width = first.aux_hidden_states.shape[-1]
    if aux_width % hidden:
        raise InvalidSample(first.sample_key, path, f"aux width {aux_width} is not a multiple of hidden size {hidden}")
    with ShardWriter(path, samples, first.final_hidden_states.dtype, hidden, aux_width // hidden,
                     store_dtype) as shard:
        for s in samples:
            shard.add(s)
        summary = shard.close()
    assert summary is not None
    return summary


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
    rows = x.detach().reshape(x.shape[0], groups, -1)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    # the max of |value| is exact in the input's dtype; the division promotes to float32 (no float32 copy first)
    scales = (rows.abs().amax(-1).float() / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)  # all-zero stays 0
    return torch.div(rows, scales.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape), scales


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


def remove_unfinished_shards(version_dir: Path) -> int:
    """Remove the temporary files of shards whose writer died (a killed run's batches); returns how
    many. Only while no other run writes the version (the flow holds its version lock)."""
    folder = Path(version_dir) / "shards"
    if not folder.is_dir():
        return 0
    unfinished = [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    for path in unfinished:
        path.unlink(missing_ok=True)
    return len(unfinished)


def _check_sample(path: Path, s: TrainingSample, planned: _Planned, dtype: torch.dtype, hidden: int,
                  aux_width: int) -> None:
    def bad(reason: str) -> InvalidSample:
        return InvalidSample(s.sample_key, path, reason)
    t = s.input_ids.numel()
    if t == 0 or s.input_ids.shape != (t,) or s.input_ids.dtype != torch.int64:
        raise bad(f"input_ids must be int64 [T>0], got {s.input_ids.dtype} {tuple(s.input_ids.shape)}")
    if t != planned.tokens:
        raise bad(f"{t} tokens, planned with {planned.tokens}")
    if s.loss_mask.shape != (t,) or s.loss_mask.dtype != torch.int64:
        raise bad(f"loss_mask must be int64 [{t}], got {s.loss_mask.dtype} {tuple(s.loss_mask.shape)}")
    if not bool(((s.loss_mask == 0) | (s.loss_mask == 1)).all()):
        raise bad("loss_mask holds values other than 0 and 1")
    if int(s.loss_mask.sum()) != planned.num_supervised:
        raise bad(f"{int(s.loss_mask.sum())} supervised tokens, planned with {planned.num_supervised}")
    if (s.final_hidden_states.shape != (t, hidden) or s.prenorm_hidden_states.shape != (t, hidden)
            or s.aux_hidden_states.shape != (t, aux_width)):
        raise bad(f"hidden states aux {tuple(s.aux_hidden_states.shape)} final {tuple(s.final_hidden_states.shape)}"
                  f" pre-norm {tuple(s.prenorm_hidden_states.shape)} do not fit [{t}, {aux_width}] and "
                  f"[{t}, {hidden}] (the shard's shapes)")
    states = (s.aux_hidden_states, s.final_hidden_states, s.prenorm_hidden_states)
    if any(x.dtype != dtype for x in states):
        raise bad(f"hidden states of dtypes {'/'.join(str(x.dtype) for x in states)}, the shard's are {dtype}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
