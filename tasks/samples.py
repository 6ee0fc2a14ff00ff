"""The two sample types: a prompt ready to send, and what its dump made of it.

Plain dataclasses (torch only): the extraction core imports them on a GPU node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PreparedSample:
    sample_key: str
    source_id: str
    line: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


@dataclass(frozen=True)
class TrainingSample:
    sample_key: str
    source_id: str
    input_ids: torch.Tensor            # int64 [T]
    loss_mask: torch.Tensor            # int64 [T], 0/1
    aux_hidden_states: torch.Tensor    # [T, k*H], target dtype
    final_hidden_states: torch.Tensor  # [T, H], after the final norm
    prenorm_hidden_states: torch.Tensor  # [T, H], before it
