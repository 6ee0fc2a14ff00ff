"""speculators' offline format (speculators 0.9.0: ``speculators/train/data.py`` ``ArrowDataset``
with hs_connectors' ``FileTransfer``), trained with ``--data-path {export folder}``::

    data-*.arrow, dataset_info.json, state.json   a datasets ``save_to_disk`` folder
                                  (``load_from_disk(data_path)``), torch format, row i:
                                  input_ids int64 [T], loss_mask int64 [T], seq_len
    hidden_states/hs_{i}.safetensors  row i's states: token_ids int64 [T], hidden_states [T, k+1, H]
                                  = the k aux taps, then the final state BEFORE the model's final norm
    token_freq.pt                 {target_id: count}: speculators' draft-vocabulary input (the version's)

The reader checks ``token_ids`` against the row's ``input_ids``, takes ``hidden_states[:, :-1]
.flatten(1)`` as the draft's [T, kH] input and ``hidden_states[:, -1]`` as
``verifier_last_hidden_states``, to which the trainer applies the verifier's norm and lm_head
(speculators/models/eagle3/core.py): hence the pre-norm state (norming a post-norm state twice
was speculators PR #313).

The reader pairs row i with ``hs_{i}``, so the numbers are dense: when samples left the
manifest, the files above the gaps are renamed down (each rename recorded in the export
index) before the row table is rewritten, in number order.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tasks.exports.writer import ExportIndex, PerSampleFileExport, require_final_state
from tasks.training_set import DatasetInfo, TrainingSetDataset, atomic_write
from tasks.vocab_mapping import TOKEN_FREQ_NAME

HIDDEN_STATES_FOLDER = "hidden_states"


def _file(sample_key: str, idx: int) -> str:
    return f"{HIDDEN_STATES_FOLDER}/hs_{idx}.safetensors"


def _payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    aux = item["aux_hidden_states"]
    taps = aux.reshape(aux.shape[0], len(info.layer_ids), info.hidden_size)
    return {"token_ids": item["input_ids"],
            "hidden_states": torch.cat([taps, item["prenorm_hidden_states"].unsqueeze(1)], dim=1)}


def _save(payload: dict, path: Path) -> None:
    save_file(payload, str(path))


def _check(info: DatasetInfo) -> None:
    require_final_state("speculators", info, "pre_norm", "speculators' trainer applies the final norm itself "
                        "and needs the final state before it")


def _finish(index: ExportIndex, dataset: TrainingSetDataset) -> None:
    out = index.path.parent
    live = sorted((e["idx"], key) for key, e in index.entries.items() if e["content_hash"] is not None)
    if [idx for idx, _ in live] != list(range(len(live))):
        index.forget_retracted()
        for row, (idx, key) in enumerate(live):
            if idx != row:  # idx > row: its target was freed by a retracted sample or moved down already
                entry = index.entries[key]
                os.replace(out / entry["file"], out / _file(key, row))
                index.record(key, row, _file(key, row), entry["content_hash"], entry["bytes"])
    position = {key: i for i, key in enumerate(dataset.manifest["sample_key"].to_list())}
    _write_rows(out, [dataset.tokens(position[key]) for _, key in live])
    token_freq = dataset.version_dir / TOKEN_FREQ_NAME
    atomic_write(out / TOKEN_FREQ_NAME, lambda tmp: shutil.copyfile(token_freq, tmp))


def _write_rows(out: Path, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The row table as a datasets folder: saved beside, then each file renamed into place."""
    import datasets  # takes seconds to import; only this export needs it

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    table = datasets.Dataset.from_dict({"input_ids": [ids.tolist() for ids, _ in rows],
                                        "loss_mask": [mask.tolist() for _, mask in rows],
                                        "seq_len": [int(ids.numel()) for ids, _ in rows]}, features=features)
    table.set_format(type="torch")
    staging = out / ".rows.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    table.save_to_disk(str(staging))
    new = {p.name for p in staging.iterdir()}
    for old in out.glob("data-*.arrow"):
        if old.name not in new:
            old.unlink()
    # the data files first: state.json, which names them, is renamed last
    for name in sorted(new, key=lambda n: n == "state.json"):
        os.replace(staging / name, out / name)
    staging.rmdir()


SPECULATORS = PerSampleFileExport("speculators", (".safetensors",), _file, _payload, _check, _save, _finish)
