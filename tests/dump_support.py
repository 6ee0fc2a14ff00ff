"""Writing dump pieces in tests: one writer configuration and one way to submit a chunk."""

from __future__ import annotations

import torch

from patches.dumps import DumpSettings, DumpWriter, prompt_hash

H, LAYERS = 8, (2, 4, 5)


def make_writer(folder, **kw) -> DumpWriter:
    return DumpWriter(DumpSettings(folder, "eagle3-", "tiny", LAYERS, **kw))


def submit(writer, rid, ids, start, end, *, aux=None, final=None, mode="extend"):
    """Submit tokens ``[start, end)`` of prompt ``ids``; random states unless given (whole-prompt tensors sliced)."""
    n = end - start
    return writer.submit(rid, chunk_start=start, input_ids=torch.tensor(ids[start:end]), prompt_len=len(ids),
                         prompt_hash=prompt_hash(ids), forward_mode=mode,
                         aux_hidden_states=torch.randn(n, 3 * H) if aux is None else aux,
                         final_hidden_states=torch.randn(n, H) if final is None else final)
