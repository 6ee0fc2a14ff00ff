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
def reference_hidden_states(model, input_ids: Sequence[int], layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, k*H] = HF hidden_states[i] for i in layer_ids, final [T, H] = last entry, post-norm)."""
    out = model(torch.tensor([list(input_ids)]), output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i][0] for i in layer_ids], dim=-1)
    return aux, hs[-1][0]
