"""Write a safetensors file straight from tensors' memory, and read one straight into it.

``safetensors.torch.save`` builds the whole file as one ``bytes`` object first (a second
copy of every tensor); a dump writer moving GB/s and a shard writer holding a batch cannot
afford that. The file written here is plain safetensors (8-byte little-endian header
length, JSON header, 8-byte aligned data), so any safetensors reader opens it.

Reading is the mirror image: ``read_header`` takes the header with two ``pread`` calls and
``read_into`` puts a tensor's bytes where the caller wants them (``preadv``). ``safe_open``
maps the whole file instead; a client reading GB/s of dumps from many threads then pays a
page fault per page and a TLB shootdown per unmap, on one address space's lock.

torch and the standard library only: it runs inside SGLang's server processes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

SAFETENSORS_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.float32: "F32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.uint8: "U8",
                      torch.float8_e4m3fn: "F8_E4M3"}
DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
#: a header past this is not one of ours (safetensors' own limit is 100 MB)
MAX_HEADER_BYTES = 100_000_000

#: (name, dtype, shape, parts): the parts' bytes (any buffer: a numpy array, bytes), back to back,
#: are the tensor's data
Column = tuple[str, torch.dtype, Sequence[int], Sequence]


def byte_view(t: torch.Tensor):
    """The tensor's bytes as a buffer, without a copy when it is a contiguous CPU tensor (bf16 too)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors(fd: int, columns: Sequence[Column], metadata: dict[str, str]) -> int:
    """Write header and data to the file open as ``fd``, in as few ``writev`` calls as the kernel allows.

    No torch call and one system call for the whole file: a thread that writes while another
    thread of its process runs Python waits up to a switch interval (5 ms) for the GIL after
    every call that released it (the dump writer beside SGLang's scheduler). Returns the bytes written.
    """
    header: dict = {"__metadata__": metadata}
    buffers, cursor = [], 0
    for name, dtype, shape, parts in columns:
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        if size != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {size} bytes of data for shape {list(shape)} of {dtype}")
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [cursor, cursor + size]}
        buffers += views
        cursor += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors writes it
    buffers = [memoryview(struct.pack("<Q", len(header_bytes)) + header_bytes), *buffers]
    total = sum(b.nbytes for b in buffers)
    while buffers:
        n = os.writev(fd, buffers)
        while buffers and n >= buffers[0].nbytes:  # drop what was written whole, cut into the rest
            n -= buffers[0].nbytes
            buffers.pop(0)
        if buffers:
            buffers[0] = buffers[0][n:]
    return total


class HeaderError(ValueError):
    """The file is not a well-formed safetensors file (the message says why, not which file)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype, shape and bytes ``[start, end)`` in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(fd: int) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """(metadata, tensors) of the safetensors file open as ``fd``; offsets are absolute."""
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise HeaderError(f"{len(head)} bytes, shorter than the header length")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {size} is past {MAX_HEADER_BYTES}")
    raw = os.pread(fd, size, 8)
    if len(raw) != size:
        raise HeaderError(f"header of {size} bytes is cut at {len(raw)}")
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__", None) or {}
        tensors = {name: TensorEntry(DTYPES_BY_NAME[e["dtype"]], tuple(int(n) for n in e["shape"]),
                                     8 + size + int(e["data_offsets"][0]), 8 + size + int(e["data_offsets"][1]))
                   for name, e in header.items()}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise HeaderError(f"unreadable header: {type(exc).__name__}: {exc}") from exc
    for name, e in tensors.items():
        if (e.end - e.start) != math.prod(e.shape) * e.dtype.itemsize:
            raise HeaderError(f"tensor {name!r}: {e.end - e.start} bytes for shape {list(e.shape)} of {e.dtype}")
    return metadata, tensors


def read_into(fd: int, entry: TensorEntry, out: torch.Tensor) -> None:
    """The tensor's bytes into ``out`` (contiguous, CPU, exactly as many bytes); short file: HeaderError."""
    view = out.reshape(-1).view(torch.uint8).numpy()
    if view.nbytes != entry.end - entry.start:
        raise ValueError(f"{view.nbytes} bytes of room for a tensor of {entry.end - entry.start}")
    offset, done = entry.start, 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise HeaderError(f"the file ends {view.nbytes - done} bytes before its tensor's end at {entry.end}")
        done += n

