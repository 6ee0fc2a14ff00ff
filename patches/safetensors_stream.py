"""Write a safetensors file straight from tensors' memory: no serialised copy of the data.

``safetensors.torch.save`` builds the whole file as one ``bytes`` object first (a second
copy of every tensor); a dump writer moving GB/s and a shard writer holding a batch cannot
afford that. The file written here is plain safetensors (8-byte little-endian header
length, JSON header, 8-byte aligned data), so any safetensors reader opens it.

torch and the standard library only: it runs inside SGLang's server processes.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO, Sequence

import torch

SAFETENSORS_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.float32: "F32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.uint8: "U8",
                      torch.float8_e4m3fn: "F8_E4M3"}

#: (name, dtype, shape, parts): the parts' bytes, back to back, are the tensor's data
Column = tuple[str, torch.dtype, Sequence[int], Sequence[torch.Tensor]]


def byte_view(t: torch.Tensor):
    """The tensor's bytes as a buffer, without a copy when it is a contiguous CPU tensor (bf16 too)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_safetensors(f: BinaryIO, columns: Sequence[Column], metadata: dict[str, str]) -> int:
    """Write header and data to the open file ``f``; returns the bytes written."""
    header: dict = {"__metadata__": metadata}
    cursor = 0
    for name, dtype, shape, parts in columns:
        size = sum(p.numel() for p in parts) * dtype.itemsize
        if any(p.dtype != dtype for p in parts):
            raise ValueError(f"tensor {name!r}: parts of dtypes {sorted({str(p.dtype) for p in parts})}, declared {dtype}")
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [cursor, cursor + size]}
        cursor += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors writes it
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for _, _, _, parts in columns:
        for part in parts:
            f.write(byte_view(part))
    return 8 + len(header_bytes) + cursor
