"""The hidden-state dump protocol: one module writes and reads it.

A *dump piece* is what a server writes for one request in one prefill (EXTEND)
forward, i.e. one chunk of a (possibly chunked) prefill. It is a safetensors file
in the dump folder, named after the request, never after a counter::

    {safe_rid}.{chunk_start:09d}.{piece_nonce}.dump.safetensors

``safe_rid`` is the rid with unsafe characters replaced plus a hash of the raw rid
(so two rids never share a name); ``piece_nonce`` makes a second write of the same
chunk a visible duplicate instead of a silent overwrite.

Tensors:
    ``input_ids``            int64 ``[n]``      the chunk's token ids
    ``aux_hidden_states``    ``[n, k*H]``       residual stream entering the aux layers, concatenated
    ``final_hidden_states``  ``[n, H]``         last layer's output after the model's final norm
    ``prenorm_hidden_states`` ``[n, H]``        the same state before the final norm

Both final states are stored as the engine computed them (:data:`FINAL_STATES`): each trainer
takes one or the other (SpecForge and ModelOpt the post-norm state, speculators the pre-norm
one and applies the norm itself). Deriving the post-norm state from the stored pre-norm one
and the norm's weights is exact for the transformers engine but not for SGLang, whose fused
add + norm normalizes the unrounded fp32 sum (18% of the values differ in bf16:
``python -m bench.final_states``, README).

Metadata (safetensors string header, ``format == "eagle3-dump"``, ``version == "3"``):
    rid, chunk_start, chunk_len, prompt_len, prompt_hash (of the whole prompt's ids),
    layer_ids (JSON list), layer_convention, final_states, dtype, model, forward_mode,
    checksum (JSON list, see :func:`fold_checksums`), instance (the writing server's launch
    nonce: a reader told its own server's instance refuses any other's pieces as foreign).

``checksum`` is computed where the values are produced (on the GPU, on the forward's own
stream, before anything else can write their memory) and recomputed by the reader from
the bytes it read: a copy to the host that raced with later GPU work, a torn write or a
bit flip on the way is a :class:`DumpCorrupt`, never a training sample. It is exact
integer arithmetic on the values' bit patterns (sums wrap modulo 2**64, so the order of
summation on GPU or CPU cannot change it), per column group: the token ids, each aux tap,
the post-norm and the pre-norm final state; for each, the sum of the row sums and the sum of row sum x (row + 1),
so that rows in the wrong order are caught too.

A request's prefill is complete when its pieces cover ``[0, prompt_len)`` exactly
once: the piece that ends at ``prompt_len`` is the last one the server writes for
that prefill, and a rid's pieces are written in order by the one writer thread its rid
maps to, so once it is visible every earlier piece is too (or was never written, which
the reader reports).

Files appear atomically: written under a dot-prefixed temporary name in the same
folder, then renamed. A writer that cannot write a piece (byte budget, full disk,
vanished folder) leaves ``{safe_rid}.error.json`` with the reason, which the reader
raises as :class:`DumpWriteFailed`.

This module must import inside an SGLang server process: torch, safetensors and the
standard library only.
"""

from __future__ import annotations

import array
import gc
import hashlib
import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from patches.safetensors_stream import TensorEntry, read_header, read_into, write_safetensors

log = logging.getLogger(__name__)

DUMP_FORMAT = "eagle3-dump"
#: only requests whose rid starts with this are dumped (the flow sends "<prefix><key>-a<attempt>-<nonce>");
#: a warmup's or health check's rid never does
RID_PREFIX = "eagle3-"
DUMP_VERSION = "3"
PIECE_SUFFIX = ".dump.safetensors"
ERROR_SUFFIX = ".error.json"
#: layer ids index Hugging Face ``outputs.hidden_states``: id i is the residual stream
#: entering decoder layer i (SGLang's and speculators' convention).
LAYER_CONVENTION = "hf_hidden_states_index"
#: the final states every dump holds: ``final_hidden_states`` after the model's final norm,
#: ``prenorm_hidden_states`` before it (the residual stream leaving the last decoder layer)
FINAL_STATES = "post_norm+pre_norm"

_PIECE_TENSORS = ("input_ids", "aux_hidden_states", "final_hidden_states", "prenorm_hidden_states")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default taps, HF ``hidden_states`` indices ``[2, N//2, N-3]``."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 1:
        raise ValueError(f"a model with {num_layers} layers has no three distinct default aux layers: {ids}")
    return ids


def prompt_hash(token_ids: Sequence[int]) -> str:
    """Content hash of a token sequence (int64 little-endian, sha256, 32 hex chars)."""
    buf = array.array("q", token_ids)
    if buf.itemsize != 8:
        raise RuntimeError("array('q') is not 64-bit on this platform")
    return hashlib.sha256(buf.tobytes()).hexdigest()[:32]


_INT_VIEW = {2: torch.int16, 4: torch.int32}
#: per float dtype: the bits of the magnitude, and the smallest magnitude that is Inf or NaN
_NON_FINITE_BITS = {torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00),
                    torch.float32: (0x7FFFFFFF, 0x7F800000)}


def row_checksums(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, prenorm: torch.Tensor,
                  num_taps: int) -> torch.Tensor:
    """Per row, the int64 sum of each column group's bit patterns: ``[rows, 3 + num_taps]``.

    Groups: token ids, aux tap 0..k-1, post-norm final state, pre-norm final state. Runs on
    the tensors' device (the patch calls it on the GPU, the reader on the CPU) and gives the
    same integers on both.
    """
    return _scan_rows(input_ids, aux, final, prenorm, num_taps, check_finite=False)[0]


def _scan_rows(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, prenorm: torch.Tensor,
               num_taps: int, check_finite: bool) -> tuple[torch.Tensor, bool]:
    """(:func:`row_checksums`, whether every hidden state is finite: True unless ``check_finite``)."""
    rows, h = int(final.shape[0]), int(final.shape[-1])
    view = _INT_VIEW[final.element_size()]
    states = [aux.reshape(rows, num_taps, h).view(view), final.reshape(rows, 1, h).view(view),
              prenorm.reshape(rows, 1, h).view(view)]
    scans = [_int_row_sums(t, final.dtype if check_finite else None) for t in states]
    sums = torch.cat([input_ids.reshape(rows, 1).to(torch.int64), *(s for s, _ in scans)], dim=1)
    return sums, all(finite for _, finite in scans)


#: rows per block of the CPU scan: a block stays in cache between its sum and its Inf/NaN test,
#: one read from memory instead of two (1.6x the speed a thread); large enough that a piece is a
#: few dozen numpy calls, each releasing the GIL the other extraction threads contend for
_SCAN_BLOCK_ROWS = 256


def _int_row_sums(bits: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, bool]:
    """(``bits.sum(dim=-1)`` as int64 exactly, whether no value of float ``dtype`` is Inf or NaN;
    with ``dtype`` None that test is skipped and True).

    On the GPU (the capture path) no test: its answer would make the forward stream wait.
    On the CPU through numpy, block by block (the reader checks GB/s; ~10x torch's widening
    sum); a 16-bit row of <= 65536 values fits int32.
    """
    if bits.is_cuda:
        if dtype is not None:
            raise ValueError("the Inf/NaN test runs on the CPU (the reader), not in the GPU's capture path")
        return bits.sum(dim=-1, dtype=torch.int64), True
    mask, limit = _NON_FINITE_BITS[dtype] if dtype is not None else (0, 1)
    acc = np.int32 if bits.element_size() == 2 and bits.shape[-1] <= 65536 else np.int64
    values = bits.numpy()
    sums = np.empty(values.shape[:-1], dtype=acc)
    magnitude = np.empty((_SCAN_BLOCK_ROWS,) + values.shape[1:], dtype=values.dtype) if dtype is not None else None
    largest = 0
    for start in range(0, values.shape[0], _SCAN_BLOCK_ROWS):
        block = values[start:start + _SCAN_BLOCK_ROWS]
        block.sum(axis=-1, dtype=acc, out=sums[start:start + len(block)])
        if dtype is not None:
            np.bitwise_and(block, mask, out=magnitude[:len(block)])
            largest = max(largest, int(magnitude[:len(block)].max()))
    return torch.from_numpy(sums.astype(np.int64, copy=False)), largest < limit


def fold_checksums(rows: torch.Tensor) -> list[int]:
    """A piece's checksum from its ``row_checksums``: per group, the sum of the row sums, then
    the sum of row sum x (row + 1). Integer sums wrap modulo 2**64 whatever their order."""
    return checksum_prefix(rows)[-1].tolist()


def checksum_prefix(rows: torch.Tensor) -> torch.Tensor:
    """Running sums of a forward's :func:`row_checksums` ``[R, g]``, from which any run of its rows
    gets its :func:`fold_checksums` in O(1) (:func:`fold_from_prefix`): ``[R + 1, 2g]`` int64, row k the
    sums over rows before k of the row sums, then of row sum x (row + 1). Wraps modulo 2**64 as the fold does."""
    weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64, device=rows.device).unsqueeze(1)
    running = torch.cat([rows, rows * weights], dim=1).cumsum(dim=0)
    return torch.cat([running.new_zeros(1, running.shape[1]), running])


def fold_from_prefix(before: Sequence[int], after: Sequence[int], start: int) -> list[int]:
    """:func:`fold_checksums` of rows ``[start, end)`` from rows ``start`` and ``end`` of their
    :func:`checksum_prefix`: the weighted sums restart at 1 by taking ``start`` x the plain ones off."""
    groups = len(before) // 2
    plain = [a - b for a, b in zip(after[:groups], before[:groups])]
    weighted = [a - b - start * p for a, b, p in zip(after[groups:], before[groups:], plain)]
    return [((v + 2**63) % 2**64) - 2**63 for v in plain + weighted]


def piece_checksum(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, prenorm: torch.Tensor,
                   num_taps: int) -> list[int]:
    """The checksum of one piece, as its metadata stores it (what the reader recomputes)."""
    return check_piece(input_ids, aux, final, prenorm, num_taps)[0]


def check_piece(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, prenorm: torch.Tensor,
                num_taps: int) -> tuple[list[int], bool]:
    """(the piece's checksum, whether its hidden states are all finite), in one pass over its bytes."""
    sums, finite = _scan_rows(input_ids, aux, final, prenorm, num_taps, check_finite=True)
    return fold_checksums(sums), finite


def safe_rid(rid: str) -> str:
    """A file-name-safe, collision-free name for a rid."""
    digest = hashlib.sha256(rid.encode("utf-8")).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', rid)[:80]}-{digest}"


# --------------------------------------------------------------------------- errors


class DumpError(Exception):
    """A request's dump cannot be used. ``rid`` and ``dump_dir`` say which one."""

    def __init__(self, rid: str, dump_dir: Path | str, reason: str):
        self.rid, self.dump_dir, self.reason = rid, str(dump_dir), reason
        super().__init__(f"dump of rid {rid!r} in {dump_dir}: {reason}")


class DumpMissing(DumpError):
    """No piece (and no error marker) appeared for the rid."""


class DumpIncomplete(DumpError):
    """Pieces exist but do not cover the prompt from token 0 (e.g. a prefix-cache hit)."""


class DumpOverlap(DumpError):
    """Two pieces cover the same tokens."""


class DumpDuplicate(DumpOverlap):
    """The same chunk was written twice."""


class DumpForeign(DumpError):
    """A piece belongs to another request or prompt (rid, hash or token ids differ)."""


class DumpCorrupt(DumpError):
    """A piece cannot be parsed, or its shapes/values are wrong."""


class DumpWriteFailed(DumpError):
    """The server's writer reported it could not write this rid's dump."""


# --------------------------------------------------------------------------- writer


@dataclass(frozen=True)
class DumpSettings:
    """What a server needs to know to write dumps (shared by the patch and the local server)."""

    dump_dir: Path
    rid_prefix: str
    model: str
    layer_ids: tuple[int, ...]
    #: bytes of host memory queued for writing at most; over it a piece is refused (error marker).
    max_pending_bytes: int = 4 << 30
    #: bytes in the dump folder at most (None: unlimited); over it a piece is refused.
    max_dir_bytes: int | None = None
    queue_pieces: int = 4096
    #: writer threads; a rid always maps to the same one, which keeps its pieces in order.
    #: One thread writes ~0.5 GB/s into /dev/shm; an H200 prefills ~3.3 GB/s of dumps at H=4096;
    #: 12 kept up on it (bench/results-sglang-load-2026-12-03.md). Waiting threads sleep.
    writer_threads: int = 12
    #: this server launch's nonce, written into every piece (launchers always set a fresh one)
    instance: str = ""

    def to_json(self) -> dict:
        """JSON-able, for settings that travel to server processes (the SGLang hook's config)."""
        return {"dump_dir": str(self.dump_dir), "rid_prefix": self.rid_prefix, "model": self.model,
                "layer_ids": list(self.layer_ids), "max_pending_bytes": self.max_pending_bytes,
                "max_dir_bytes": self.max_dir_bytes, "queue_pieces": self.queue_pieces,
                "writer_threads": self.writer_threads, "instance": self.instance}

    @classmethod
    def from_json(cls, d: dict) -> "DumpSettings":
        return cls(Path(d["dump_dir"]), str(d["rid_prefix"]), str(d["model"]), tuple(int(i) for i in d["layer_ids"]),
                   int(d["max_pending_bytes"]), None if d["max_dir_bytes"] is None else int(d["max_dir_bytes"]),
                   int(d["queue_pieces"]), int(d["writer_threads"]), str(d["instance"]))


@dataclass(frozen=True)
class ForwardRows:
    """One forward's captured rows in host memory, shared by its pieces, as the writer needs them.

    Each column is a numpy byte view ``[R, row bytes]`` of a host tensor, so that a writer thread
    slices and writes it without a torch call (:func:`patches.safetensors_stream.write_safetensors`
    says why); ``checksum_prefix`` is the :func:`checksum_prefix` of the rows' checksums. With
    ``ready`` (a CUDA event), the memory is valid once the event is.
    """

    input_ids: np.ndarray
    aux: np.ndarray
    final: np.ndarray
    prenorm: np.ndarray
    checksum_prefix: np.ndarray
    dtype: torch.dtype  # of the hidden states
    num_taps: int
    hidden: int
    ready: object | None

    @classmethod
    def of(cls, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, prenorm: torch.Tensor,
           checksum_prefix: torch.Tensor, num_taps: int, ready: object | None) -> "ForwardRows":
        """From host tensors: int64 ids ``[R]``, aux ``[R, k*H]``, final and pre-norm ``[R, H]``."""
        def rows(t: torch.Tensor) -> np.ndarray:
            return t.contiguous().view(torch.uint8).numpy().reshape(int(t.shape[0]), -1)
        if input_ids.dtype != torch.int64:
            raise ValueError(f"token ids of dtype {input_ids.dtype}, not int64")
        return cls(rows(input_ids), rows(aux), rows(final), rows(prenorm), checksum_prefix.numpy(),
                   final.dtype, num_taps, int(final.shape[-1]), ready)

    @property
    def row_bytes(self) -> int:
        return sum(c.shape[1] for c in (self.input_ids, self.aux, self.final, self.prenorm))


@dataclass
class _Piece:
    rid: str
    chunk_start: int
    prompt_len: int
    prompt_hash: str
    forward_mode: str
    rows: ForwardRows
    row_start: int  # of the piece's rows in ``rows``
    row_end: int
    nbytes: int
    queued_at: float  # time.monotonic() at submit


class DumpWriter:
    """Background writer: ``submit`` never touches the disk; threads write from the tensors' memory.

    The model's forward hands host tensors (or pinned tensors plus a CUDA event) to
    ``submit``; a writer thread, chosen by the rid so that a rid's pieces stay in order,
    writes them straight from that memory and renames. Failures become error
    markers and log lines, never exceptions in the caller. Once a rid has failed, its
    later pieces are dropped: the client gives up on the marker and deletes the rid's
    files, and a piece written after that would be left behind for nobody.
    """

    #: failed rids remembered (oldest forgotten first); far more than requests in flight
    failed_rids_kept = 4096
    #: a piece that lands later than this after its submit is logged (a piece lands within ~0.1 s under
    #: load; at the end of a load run the last ones landed 1-4.7 s late, their threads waiting for the GIL that an
    #: idle scheduler's Python loop held: results file, runs O and P)
    slow_piece_s = 1.0

    def __init__(self, settings: DumpSettings):
        self.settings = settings
        self.dump_dir = Path(settings.dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        per_thread = max(1, settings.queue_pieces // settings.writer_threads)
        self._queues: list[queue.Queue[_Piece | None]] = [queue.Queue(maxsize=per_thread)
                                                          for _ in range(settings.writer_threads)]
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._failed_rids: OrderedDict[str, None] = OrderedDict()
        self.written = 0
        self.written_bytes = 0
        self.refused = 0
        self.last_error: str | None = None
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"dump-writer-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def wants(self, rid: str | None) -> bool:
        return bool(rid) and rid.startswith(self.settings.rid_prefix)

    def submit(self, rid: str, rows: ForwardRows, row_start: int, row_end: int, *, chunk_start: int,
               prompt_len: int, prompt_hash: str, forward_mode: str = "extend") -> bool:
        """Queue rows ``[row_start, row_end)`` of ``rows`` as one piece of ``rid``. Returns False (and
        leaves an error marker) if it was refused."""
        nbytes = (row_end - row_start) * rows.row_bytes
        if self._drop_if_failed(rid):
            return False
        with self._lock:
            over_budget = self._pending_bytes + nbytes > self.settings.max_pending_bytes
            if not over_budget:
                self._pending_bytes += nbytes
        if over_budget:
            self._refuse(rid, f"writer queue over its budget of {self.settings.max_pending_bytes} bytes")
            return False
        piece = _Piece(rid, chunk_start, prompt_len, prompt_hash, forward_mode, rows, row_start, row_end,
                       nbytes, time.monotonic())
        try:
            self._queues[zlib.crc32(rid.encode()) % len(self._queues)].put_nowait(piece)
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
            self._refuse(rid, f"writer queue full ({self.settings.queue_pieces} pieces)")
            return False
        return True

    def fail(self, rid: str, reason: str) -> None:
        """Record that the server cannot dump ``rid`` (error marker + log line); never raises."""
        self._refuse(rid, reason)

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queues and stop the threads."""
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.error("dump writer in %s did not drain within %ss", self.dump_dir, timeout)

    def stats(self) -> dict:
        with self._lock:
            return {"dump_dir": str(self.dump_dir), "written": self.written, "written_bytes": self.written_bytes,
                    "refused": self.refused, "pending_bytes": self._pending_bytes,
                    "max_pending_bytes": self.settings.max_pending_bytes,
                    "queued": sum(q.qsize() for q in self._queues), "threads": len(self._threads),
                    "last_error": self.last_error}

    # -- thread side

    def _run(self, pieces: queue.Queue) -> None:
        while True:
            piece = pieces.get()
            if piece is None:
                return
            try:
                if not self._drop_if_failed(piece.rid):  # it failed after this piece was queued
                    self._write(piece)
            except Exception as exc:  # reported as a marker: the server must keep serving
                self._refuse(piece.rid, f"{type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._pending_bytes -= piece.nbytes

    def _write(self, piece: _Piece) -> None:
        # No torch call from here on but the event's: each would give up the GIL and, beside a
        # scheduler thread running Python, wait up to 5 ms to get it back (write_safetensors)
        taken = time.monotonic()
        fwd = piece.rows
        if fwd.ready is not None:
            fwd.ready.synchronize()
        copied = time.monotonic()
        s, a, b = self.settings, piece.row_start, piece.row_end
        n = b - a
        checksum = fold_from_prefix(fwd.checksum_prefix[a].tolist(), fwd.checksum_prefix[b].tolist(), a)
        meta = {
            "format": DUMP_FORMAT, "version": DUMP_VERSION, "rid": piece.rid,
            "chunk_start": str(piece.chunk_start), "chunk_len": str(n),
            "prompt_len": str(piece.prompt_len), "prompt_hash": piece.prompt_hash,
            "layer_ids": json.dumps(list(s.layer_ids)), "layer_convention": LAYER_CONVENTION,
            "final_states": FINAL_STATES, "dtype": str(fwd.dtype).removeprefix("torch."),
            "model": s.model, "forward_mode": piece.forward_mode,
            "checksum": json.dumps(checksum), "instance": s.instance,
        }
        columns = [("input_ids", torch.int64, (n,), [fwd.input_ids[a:b]]),
                   ("aux_hidden_states", fwd.dtype, (n, fwd.num_taps * fwd.hidden), [fwd.aux[a:b]]),
                   ("final_hidden_states", fwd.dtype, (n, fwd.hidden), [fwd.final[a:b]]),
                   ("prenorm_hidden_states", fwd.dtype, (n, fwd.hidden), [fwd.prenorm[a:b]])]
        if s.max_dir_bytes is not None:
            used = _dir_bytes(self.dump_dir)
            if used + piece.nbytes > s.max_dir_bytes:
                raise OSError(f"dump folder holds {used} bytes; {piece.nbytes} more would pass its cap of {s.max_dir_bytes}")
        name = f"{safe_rid(piece.rid)}.{piece.chunk_start:09d}.{uuid.uuid4().hex[:8]}{PIECE_SUFFIX}"
        size = _atomic_write(self.dump_dir / name, lambda fd: write_safetensors(fd, columns, meta))
        with self._lock:
            self.written += 1
            self.written_bytes += size
        landed = time.monotonic()
        if landed - piece.queued_at > self.slow_piece_s:
            # the split says where the time went: the queue (other pieces), the copy (GPU side), the write
            log.warning("dump writer: piece %s (%d bytes) landed %.2f s after it was queued: %.2f s queued, "
                        "%.2f s waiting for its copy, %.2f s writing; gc counts %s", name, size,
                        landed - piece.queued_at, taken - piece.queued_at, copied - taken, landed - copied,
                        gc.get_count())

    def _drop_if_failed(self, rid: str) -> bool:
        with self._lock:
            if rid not in self._failed_rids:
                return False
            self.refused += 1
        return True

    def _refuse(self, rid: str, reason: str) -> None:
        with self._lock:
            self.refused += 1
            if rid in self._failed_rids:
                return  # one marker per rid: the client may have read and deleted it already
            self.last_error = f"rid {rid!r}: {reason}"
            self._failed_rids[rid] = None
            if len(self._failed_rids) > self.failed_rids_kept:
                self._failed_rids.popitem(last=False)
        log.error("dump writer: cannot write rid %r to %s: %s", rid, self.dump_dir, reason)
        marker = json.dumps({"rid": rid, "reason": reason, "time": time.time()}).encode()
        try:
            _atomic_write(self.dump_dir / f"{safe_rid(rid)}{ERROR_SUFFIX}", lambda fd: os.write(fd, marker))
        except OSError as exc:  # the folder is gone or full: the log line and stats carry it
            log.error("dump writer: cannot write the error marker for rid %r in %s: %s", rid, self.dump_dir, exc)


def _atomic_write(path: Path, write) -> int:
    """``write(fd)`` into a dot-named temporary, then rename onto ``path``; returns ``write``'s result."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            result = write(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return result
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _dir_bytes(folder: Path) -> int:
    total = 0
    with os.scandir(folder) as it:
        for entry in it:
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted by a reader meanwhile
                pass
    return total


# --------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class PieceInfo:
    path: Path
    rid: str
    chunk_start: int
    chunk_len: int
    prompt_len: int
    prompt_hash: str
    forward_mode: str
    meta: dict
    #: where each tensor's bytes lie in the file (read from its header once)
    tensors: dict[str, TensorEntry]

    @property
    def chunk_end(self) -> int:
        return self.chunk_start + self.chunk_len


class ReadBuffer:
    """Host memory reused from one assembled dump to the next, for one reader at a time.

    A process that reads GB/s of dumps into fresh tensors faults every page in and unmaps it
    again for each dump; with this it does so once. The tensors of an assembled dump are
    views into it, valid until its next use.
    """

    _ALIGN = 64

    def __init__(self):
        self._storage = torch.empty(0, dtype=torch.uint8)

    def tensors(self, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        sizes = [-(-math.prod(shape) * dtype.itemsize // self._ALIGN) * self._ALIGN for dtype, shape in specs]
        if sum(sizes) > self._storage.numel():
            self._storage = torch.empty(sum(sizes), dtype=torch.uint8)
        out, cursor = [], 0
        for (dtype, shape), size in zip(specs, sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            out.append(self._storage[cursor:cursor + nbytes].view(dtype).view(shape))
            cursor += size
        return out


@dataclass(frozen=True)
class AssembledDump:
    """A request's whole-prompt hidden states, verified against its token ids."""

    rid: str
    input_ids: torch.Tensor           # int64 [T]
    aux_hidden_states: torch.Tensor   # [T, k*H]
    final_hidden_states: torch.Tensor  # [T, H], after the final norm
    prenorm_hidden_states: torch.Tensor  # [T, H], before it
    layer_ids: list[int]
    layer_convention: str
    final_states: str
    dtype: str
    model: str
    instance: str
    paths: tuple[Path, ...]


class DumpReader:
    """Finds, verifies and assembles a rid's pieces in a dump folder.

    With ``instance`` (the launch nonce of the server this run started), a piece written by
    any other server, one that shares the folder or answers on a reused port, is foreign.
    """

    def __init__(self, dump_dir: Path | str, instance: str | None = None):
        self.dump_dir = Path(dump_dir)
        self.instance = instance

    def piece_paths(self, rid: str) -> list[Path]:
        prefix = safe_rid(rid) + "."
        return sorted(self.dump_dir / n for n in _listdir(self.dump_dir)
                      if n.startswith(prefix) and n.endswith(PIECE_SUFFIX))

    def error_marker(self, rid: str) -> str | None:
        path = self.dump_dir / f"{safe_rid(rid)}{ERROR_SUFFIX}"
        try:
            return json.loads(path.read_text())["reason"]
        except FileNotFoundError:
            return None
        except (ValueError, KeyError) as exc:
            return f"unreadable error marker {path}: {exc}"

    def pieces(self, rid: str) -> list[PieceInfo]:
        infos = []
        for path in self.piece_paths(rid):
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    meta, tensors = read_header(fd)
                finally:
                    os.close(fd)
                info = PieceInfo(path, meta["rid"], int(meta["chunk_start"]), int(meta["chunk_len"]),
                                 int(meta["prompt_len"]), meta["prompt_hash"], meta["forward_mode"], meta, tensors)
            except (OSError, KeyError, ValueError) as exc:  # HeaderError is a ValueError
                raise DumpCorrupt(rid, self.dump_dir, f"cannot read piece {path.name}: {exc}") from exc
            if meta.get("format") != DUMP_FORMAT or meta.get("version") != DUMP_VERSION:
                raise DumpCorrupt(rid, self.dump_dir, f"piece {path.name} is format {meta.get('format')!r} "
                                  f"version {meta.get('version')!r}, expected {DUMP_FORMAT!r} {DUMP_VERSION!r}")
            infos.append(info)
        return infos

    def wait(self, rid: str, prompt_len: int, timeout: float, poll: float = 0.0005) -> list[PieceInfo]:
        """Wait until the piece that ends the prompt is visible (or an error marker); return all pieces.

        Raises DumpWriteFailed on a marker, DumpMissing when nothing usable appeared in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            reason = self.error_marker(rid)
            if reason is not None:
                raise DumpWriteFailed(rid, self.dump_dir, f"the server's dump writer failed: {reason}")
            infos = self.pieces(rid)
            if any(p.chunk_end == prompt_len and p.forward_mode == "extend" for p in infos):
                return infos
            if time.monotonic() >= deadline:
                seen = ", ".join(f"[{p.chunk_start},{p.chunk_end})" for p in infos) or "none"
                raise DumpMissing(rid, self.dump_dir,
                                  f"no piece ending at token {prompt_len} within {timeout:.1f}s (pieces seen: {seen})")
            # The last piece usually lands within a millisecond of the answer: look again soon,
            # then back off so that a slow writer does not cost a core in listings.
            time.sleep(poll)
            poll = min(poll * 2, 0.02)

    def assemble(self, rid: str, token_ids: Sequence[int], infos: list[PieceInfo] | None = None,
                 buffer: ReadBuffer | None = None) -> AssembledDump:
        """Verify that the rid's pieces cover ``token_ids`` exactly once and stitch them together.

        Pieces that start at or after the prompt's end (decode steps a careless hook wrote)
        are not part of the prefill and are ignored. Each piece's rows are read straight into
        their place in the whole prompt's tensors (in ``buffer`` when given: then they are
        valid until its next use), and verified there.
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        total = int(ids.numel())
        want_hash = prompt_hash(token_ids)
        if infos is None:
            infos = self.pieces(rid)
        prefill = []
        for p in infos:
            if p.rid != rid:
                raise DumpForeign(rid, self.dump_dir, f"piece {p.path.name} carries rid {p.rid!r}")
            if self.instance is not None and p.meta.get("instance") != self.instance:
                raise DumpForeign(rid, self.dump_dir, f"piece {p.path.name} was written by server instance "
                                  f"{p.meta.get('instance')!r}, not by this run's server {self.instance!r}")
            if p.forward_mode == "decode" or p.chunk_start >= total:
                continue  # a decode step (a careless hook writes them), not part of the prefill
            if p.prompt_len != total or p.prompt_hash != want_hash:
                raise DumpForeign(rid, self.dump_dir, f"piece {p.path.name} is of a prompt of {p.prompt_len} tokens "
                                  f"hash {p.prompt_hash}, expected {total} tokens hash {want_hash}")
            prefill.append(p)
        if not prefill:
            raise DumpMissing(rid, self.dump_dir, "no prefill piece")
        prefill.sort(key=lambda p: (p.chunk_start, p.chunk_end))
        cursor = 0
        for p in prefill:
            if p.chunk_start > cursor:
                what = "prefix-cache hit? " if cursor == 0 else ""
                raise DumpIncomplete(rid, self.dump_dir, f"{what}tokens [{cursor},{p.chunk_start}) of {total} have no piece")
            if p.chunk_start < cursor:
                same = [q for q in prefill if q is not p and (q.chunk_start, q.chunk_end) == (p.chunk_start, p.chunk_end)]
                cls = DumpDuplicate if same else DumpOverlap
                raise cls(rid, self.dump_dir, f"piece {p.path.name} [{p.chunk_start},{p.chunk_end}) overlaps tokens before {cursor}")
            if p.chunk_end > total:
                raise DumpCorrupt(rid, self.dump_dir, f"piece {p.path.name} ends at {p.chunk_end}, past the prompt's {total}")
            cursor = p.chunk_end
        if cursor != total:
            raise DumpIncomplete(rid, self.dump_dir, f"pieces cover [0,{cursor}) of {total} tokens")
        meta = prefill[0].meta
        layer_ids = json.loads(meta["layer_ids"])
        dtype, hidden = self._check_layout(rid, prefill, len(layer_ids))
        specs = [(torch.int64, (total,)), (dtype, (total, len(layer_ids) * hidden)), (dtype, (total, hidden)),
                 (dtype, (total, hidden))]
        whole = buffer.tensors(specs) if buffer is not None else [torch.empty(shape, dtype=d) for d, shape in specs]
        for p in prefill:
            rows = [t[p.chunk_start:p.chunk_end] for t in whole]
            self._read_piece(rid, p, rows, ids[p.chunk_start:p.chunk_end], layer_ids)
        _, aux, final, prenorm = whole
        return AssembledDump(rid, ids, aux, final, prenorm, layer_ids, meta["layer_convention"], meta["final_states"],
                             meta["dtype"], meta["model"], meta.get("instance", ""), tuple(p.path for p in infos))

    def _check_layout(self, rid: str, prefill: list[PieceInfo], taps: int) -> tuple[torch.dtype, int]:
        """(dtype, hidden size) the pieces' tensors share, their shapes fitting their tokens and ``taps``."""
        first = prefill[0].tensors.get("final_hidden_states")
        if first is None or len(first.shape) != 2:
            raise DumpCorrupt(rid, self.dump_dir, f"piece {prefill[0].path.name} has no [tokens, hidden] final state")
        dtype, hidden = first.dtype, first.shape[1]
        for p in prefill:
            n = p.chunk_len
            want = {"input_ids": (torch.int64, (n,)), "aux_hidden_states": (dtype, (n, taps * hidden)),
                    "final_hidden_states": (dtype, (n, hidden)), "prenorm_hidden_states": (dtype, (n, hidden))}
            got = {name: (e.dtype, e.shape) for name, e in p.tensors.items() if name in want}
            if got != want:
                raise DumpCorrupt(rid, self.dump_dir, f"piece {p.path.name} holds {got}, expected {want} "
                                  f"({n} tokens, {taps} aux layers, hidden size and dtype of the first piece)")
        return dtype, hidden

    def _read_piece(self, rid: str, p: PieceInfo, rows: list[torch.Tensor], want_ids: torch.Tensor,
                    layer_ids: list[int]) -> None:
        """The piece's tensors into ``rows`` (ids, aux, final, pre-norm), their checksum and ids verified."""
        try:
            fd = os.open(p.path, os.O_RDONLY)
            try:
                for name, out in zip(_PIECE_TENSORS, rows):
                    read_into(fd, p.tensors[name], out)
            finally:
                os.close(fd)
            want = json.loads(p.meta["checksum"])
        except (OSError, KeyError, ValueError) as exc:
            raise DumpCorrupt(rid, self.dump_dir, f"cannot read piece {p.path.name}: {exc}") from exc
        got, finite = check_piece(*rows, len(layer_ids))
        if got != want:
            groups = ["token ids"] + [f"aux tap {i}" for i in layer_ids] + ["final state", "pre-norm final state"]
            width = len(groups)
            bad = groups  # a checksum of another length: every group is in doubt
            if len(want) == 2 * width:  # per group: the plain sum at i, the row-weighted one at width + i
                bad = [g for i, g in enumerate(groups) if (got[i], got[width + i]) != (want[i], want[width + i])]
            raise DumpCorrupt(rid, self.dump_dir, f"piece {p.path.name} [{p.chunk_start},{p.chunk_end}): the values read "
                              f"differ from those the server checksummed at capture ({', '.join(bad)}): the copy to the "
                              f"host raced with later GPU work, or the file was damaged")
        if not finite:
            raise DumpCorrupt(rid, self.dump_dir, f"piece {p.path.name} [{p.chunk_start},{p.chunk_end}): hidden states "
                              f"hold NaN or Inf (as the server computed them: the checksum matches)")
        if not torch.equal(rows[0], want_ids):  # after the checksum: a damaged id is corrupt, not foreign
            raise DumpForeign(rid, self.dump_dir, f"piece {p.path.name} token ids differ from the request's "
                              f"at [{p.chunk_start},{p.chunk_end})")

    def delete(self, rid: str) -> int:
        """Remove every piece and marker of the rid; returns how many files went."""
        n = 0
        for path in self.piece_paths(rid) + [self.dump_dir / f"{safe_rid(rid)}{ERROR_SUFFIX}"]:
            try:
                path.unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n

    def remove_stale(self, ttl_s: float, now: float | None = None) -> int:
        """Remove pieces, markers and temporary files older than ``ttl_s``; returns how many."""
        now = time.time() if now is None else now
        n = 0
        for name in _listdir(self.dump_dir):
            if not (name.endswith(PIECE_SUFFIX) or name.endswith(ERROR_SUFFIX) or name.endswith(".tmp")):
                continue
            path = self.dump_dir / name
            try:
                if now - path.stat().st_mtime > ttl_s:
                    path.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []
