"""Take a forward's wanted rows off the GPU without racing it, and hand them to the dump writer.

Both engines (the SGLang hook and the transformers engine) capture through here. Per
forward, on the forward's own stream:

1. **Snapshot**: the wanted rows are gathered into new tensors (``torch.cat`` of row
   slices). They belong to this module alone: no later forward writes them, unlike the
   runner's static input buffers (0.5.17's ``EagerRunner.load_batch`` refills
   ``input_ids`` in place for the next batch) or the layer hooks' temporaries (freed,
   and their memory reused, as soon as the hook returns). A device-to-device copy at
   HBM speed costs ~0.1% of the forward.
2. **Checksum**: the per-row integer sums of :func:`patches.dumps.row_checksums` over the
   snapshot, on the same stream, so they describe exactly the values the forward produced;
   their running sums (:func:`patches.dumps.checksum_prefix`) give every piece its checksum
   from two rows, in a few kernels for the whole forward.
3. **Transfer** (:class:`SideStreamTransfer`): a side stream waits for the forward's stream
   (a GPU-side dependency, the scheduler never blocks), copies snapshot and checksums into
   pinned host memory, and records an event the writer thread waits on. ``record_stream``
   keeps the caching allocator from reusing the snapshot's memory until that copy is done.
   The event is a blocking one: a writer thread sleeps until the copy is done. A default
   event busy-waits, and a writer thread takes its piece when the forward is *launched*,
   up to a forward or two before the GPU gets there: several writer threads then spin at
   full speed, on the cores the scheduler, the tokenizer and the client need.

4. **Queue**: the host tensors become numpy byte views once per forward
   (:class:`patches.dumps.ForwardRows`); each piece is a row range of them, which a writer
   thread writes without a torch call.

The reader recomputes the checksum from the bytes it read; whatever went wrong between
steps 2 and the file (a racing copy, a torn write) is a corrupt dump, never a sample.

torch only (plus patches.dumps): runs inside SGLang's scheduler processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from patches.dumps import DumpWriter, ForwardRows, checksum_prefix, row_checksums

#: (owned snapshot tensors) -> (host tensors valid once the event is, the event or None)
Transfer = Callable[[Sequence[torch.Tensor]], tuple[list[torch.Tensor], object | None]]


@dataclass(frozen=True)
class PieceRows:
    """One request's rows in a forward's flat batch, and what its dump piece says of them."""

    rid: str
    chunk_start: int
    row_start: int
    row_end: int
    prompt_len: int
    prompt_hash: str
    forward_mode: str = "extend"


class SideStreamTransfer:
    """Device-to-host copies on a side stream into pinned memory; see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # see step 3 above: a waiting writer sleeps
            ready.record(self.stream)
        for t in tensors:
            t.record_stream(self.stream)
        return host, ready


_transfers: dict[int, SideStreamTransfer] = {}


def to_host(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], object | None]:
    """The default transfer: the side stream on CUDA; on CPU the snapshot already is host memory."""
    if not tensors[0].is_cuda:
        return list(tensors), None
    index = tensors[0].device.index
    if index not in _transfers:
        _transfers[index] = SideStreamTransfer(tensors[0].device)
    return _transfers[index](tensors)


def capture_pieces(writer: DumpWriter, pieces: Sequence[PieceRows], input_ids: torch.Tensor,
                   aux_parts: Sequence[torch.Tensor], final: torch.Tensor, prenorm: torch.Tensor,
                   transfer: Transfer = to_host) -> list[str]:
    """Snapshot, checksum and queue one piece per entry of ``pieces``; returns the rids queued.

    ``input_ids`` [rows], each of ``aux_parts`` [rows, H], ``final`` [rows, H] (after the final
    norm) and ``prenorm`` [rows, H] (before it) cover the forward's flat batch; a piece is rows
    ``[row_start, row_end)`` of each.
    """
    pieces = [p for p in pieces if p.row_end > p.row_start]
    if not pieces:
        return []
    spans = [slice(p.row_start, p.row_end) for p in pieces]
    ids = torch.cat([input_ids[s] for s in spans]).to(torch.int64)
    aux = torch.cat([torch.cat([a[s] for s in spans]) for a in aux_parts], dim=-1)
    fin = torch.cat([final[s] for s in spans])
    pre = torch.cat([prenorm[s] for s in spans])
    prefix = checksum_prefix(row_checksums(ids, aux, fin, pre, len(aux_parts)))
    (ids, aux, fin, pre, prefix), ready = transfer([ids, aux, fin, pre, prefix])
    rows = ForwardRows.of(ids, aux, fin, pre, prefix, len(aux_parts), ready)
    queued, row = [], 0
    for p in pieces:
        n = p.row_end - p.row_start
        if writer.submit(p.rid, rows, row, row + n, chunk_start=p.chunk_start, prompt_len=p.prompt_len,
                         prompt_hash=p.prompt_hash, forward_mode=p.forward_mode):
            queued.append(p.rid)
        row += n
    return queued
