"""ModelOpt's offline EAGLE format.

One ``{conversation}.pt`` per sample (``torch.save``), collected by ModelOpt's launcher with
``rglob("*.pt")`` and read by modelopt/torch/speculative/eagle/utils.py
``OfflineSupervisedDataset`` with ``torch.load(weights_only=True)``, which accepts these
values (tensors, str, bool): ``input_ids`` [T], ``hidden_states`` [T, H], ``aux_hidden_states``
[T, 3H], ``loss_mask`` [T], ``conversation_id``, ``hidden_states_prenorm`` (whether
``hidden_states`` is before the final norm; its trainer then applies the base model's norm,
modelopt/torch/speculative/plugins/modeling_final_norm.py). We store the post-norm state, as
the HF path does, and say so: False (ModelOpt's own vLLM path stores the pre-norm state
without the flag).
"""

from __future__ import annotations

import re

from patches.dumps import safe_rid
from tasks.exports.writer import PerSampleFileExport, require_final_state
from tasks.training_set import DatasetInfo

_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _file(sample_key: str, idx: int) -> str:
    stem = sample_key if _SAFE_NAME.fullmatch(sample_key) else safe_rid(sample_key)
    return f"{stem}.pt"


def _payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    return {"input_ids": item["input_ids"], "hidden_states": item["hidden_states"],
            "aux_hidden_states": item["aux_hidden_states"], "loss_mask": item["loss_mask"],
            "conversation_id": source_id, "hidden_states_prenorm": False}  # hidden_states is post-norm


def _check(info: DatasetInfo) -> None:
    require_final_state("modelopt", info, "post_norm", "the export stores the post-norm final state")


MODELOPT = PerSampleFileExport("modelopt", (".pt",), _file, _payload, _check)
