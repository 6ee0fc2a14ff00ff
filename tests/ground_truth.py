"""Ground truth for hidden states: the same model run directly through transformers."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=4)
def load_reference_model(model_dir: str, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=dtype).eval()


@torch.no_grad()
def all_hidden_states(model, input_ids: Sequence[int]) -> list[torch.Tensor]:
    """HF ``hidden_states`` of one sequence: entry i [T, H] enters decoder layer i; the last is post-norm."""
    return [h[0] for h in model(torch.tensor([list(input_ids)]), output_hidden_states=True).hidden_states]


def reference_hidden_states(model, input_ids: Sequence[int], layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, k*H] = HF hidden_states[i] for i in layer_ids, final [T, H] = last entry, post-norm)."""
    hs = all_hidden_states(model, input_ids)
    return torch.cat([hs[i] for i in layer_ids], dim=-1), hs[-1]


@torch.no_grad()
def final_norm_input(model, input_ids: Sequence[int]) -> torch.Tensor:
    """[T, H]: the input of ``model.model.norm`` in a direct forward, i.e. the pre-norm final state."""
    seen = []
    handle = model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0][0]))
    try:
        model(torch.tensor([list(input_ids)]))
    finally:
        handle.remove()
    (state,) = seen
    return state
