"""Writing dump pieces in tests: one writer configuration and one way to submit a chunk."""

from __future__ import annotations

import torch

from patches.capture import PieceRows, capture_pieces
from patches.dumps import DumpSettings, DumpWriter, prompt_hash

H, LAYERS = 8, (2, 4, 5)


def make_writer(folder, **kw) -> DumpWriter:
    return DumpWriter(DumpSettings(folder, "eagle3-", "tiny", LAYERS, **kw))


def submit(writer, rid, ids, start, end, *, aux=None, final=None, prenorm=None, mode="extend", prompt=None):
    """Capture tokens ``[start, end)`` of ``ids`` as the engines do (patches.capture); True if queued.

    States are random unless given ([end - start, 3H], [end - start, H] twice); ``prompt`` is the
    whole prompt the piece claims to be of (``ids`` unless given).
    """
    n, prompt = end - start, ids if prompt is None else prompt
    aux = torch.randn(n, 3 * H) if aux is None else aux
    final = torch.randn(n, H) if final is None else final
    prenorm = torch.randn(n, H) if prenorm is None else prenorm
    piece = PieceRows(rid, start, 0, n, len(prompt), prompt_hash(prompt), mode)
    return bool(capture_pieces(writer, [piece], torch.tensor(ids[start:end]), list(aux.split(H, dim=-1)), final,
                                prenorm))
