"""SpecForge's offline hidden-state format (``specforge_hidden_states_v1``).

One ``torch.save`` file per sample (zip serialisation: the reader maps it with
``torch.load(mmap=True)``) at ``rows_{g}-{g+2000}/data_{idx}.ckpt``, the layout of SpecForge's
prepare_hidden_states.py. Keys, read by specforge/algorithms/eagle3/data.py
``normalize_offline_sample`` (which squeezes dim 0): ``input_ids`` [T] int64, ``loss_mask`` [T]
int64, ``aux_hidden_state`` [1, T, 3H], ``hidden_state`` [1, T, H] after the final norm.
"""

from __future__ import annotations

from tasks.exports.writer import PerSampleFileExport, require_final_state
from tasks.training_set import DatasetInfo

ROWS_PER_FOLDER = 2000


def _file(sample_key: str, idx: int) -> str:
    group = idx // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return f"rows_{group}-{group + ROWS_PER_FOLDER}/data_{idx}.ckpt"


def _payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    return {"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
            "aux_hidden_state": item["aux_hidden_states"].unsqueeze(0),
            "hidden_state": item["hidden_states"].unsqueeze(0)}


def _check(info: DatasetInfo) -> None:
    # SpecForge's TargetHead applies lm_head alone (no final norm) to hidden_state.
    require_final_state("specforge", info, "post_norm", "SpecForge computes the target logits as "
                        "lm_head(hidden_state) and needs the post-norm final state")


SPECFORGE = PerSampleFileExport("specforge", (".ckpt", ".ckpt.gz"), _file, _payload, _check)
