"""ModelOpt's offline EAGLE format.

One ``{conversation}.pt`` per sample (``torch.save``), collected by ModelOpt's launcher with
``rglob("*.pt")`` and read by modelopt/torch/speculative/eagle/utils.py
``OfflineSupervisedDataset`` with ``torch.load(weights_only=True)``, which accepts these
values (tensors, str, bool): ``input_ids`` [T], ``hidden_states`` [T, H], ``aux_hidden_states``
[T, 3H], ``loss_mask`` [T], ``conversation_id``, ``hidden_states_prenorm`` (whether
``hidden_states`` is before the final norm).
"""

from __future__ import annotations

import re

from patches.dumps import FINAL_NORM, safe_rid
from tasks.exports.writer import ExportUnsupported, PerSampleFileExport
from tasks.training_set import DatasetInfo

_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _file(sample_key: str, idx: int) -> str:
    stem = sample_key if _SAFE_NAME.fullmatch(sample_key) else safe_rid(sample_key)
    return f"{stem}.pt"


def _payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    return {"input_ids": item["input_ids"], "hidden_states": item["hidden_states"],
            "aux_hidden_states": item["aux_hidden_states"], "loss_mask": item["loss_mask"],
            "conversation_id": source_id, "hidden_states_prenorm": info.final_norm != FINAL_NORM}


def _check(info: DatasetInfo) -> None:
    if info.final_norm not in (FINAL_NORM, "pre_norm"):
        raise ExportUnsupported(f"modelopt export of dataset version {info.fingerprint}: unknown "
                                f"final_norm={info.final_norm!r}")


MODELOPT = PerSampleFileExport("modelopt", (".pt",), _file, _payload, _check)
