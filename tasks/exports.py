"""Trainer exports: a consolidated dataset version rewritten in a trainer's own offline format.

Every export reads the samples through ``TrainingSetDataset`` (tasks.training_set holds the
schema); nothing here defines a second layout of our data. Exports live in
``{version_dir}/exports/{name}/``; each keeps ``export_index.json`` there: sample key ->
file, the content hash the file was written from, and its size.

Incremental: a file whose recorded content hash matches the manifest's and whose size is
unchanged is left alone; samples that left the manifest lose their files; files the index
does not account for (a crash between a file's rename and the index save) are removed or
rewritten. SpecForge numbers its files, so a sample's number is assigned once and kept
(append-only): numbering by position in the manifest would hand the same file name to
another sample whenever one is added or removed, the resume bug of ModelOpt PR #2080 and
SpecForge PR #295.

Layer ids: our manifest uses HF ``hidden_states`` indices (input of decoder layer i).
SpecForge and ModelOpt configure the same taps as "output of layer k" = i - 1; the index
file records those ids (``eagle_aux_hidden_state_layer_ids``) for the draft's config.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from patches.dumps import FINAL_NORM, safe_rid
from tasks.shards import TrainingSetError
from tasks.training_set import DatasetInfo, ExportSummary, TrainingSetDataset

EXPORT_INDEX_NAME = "export_index.json"
EXPORT_INDEX_FORMAT = "eagle3-export-index"
SPECFORGE_ROWS_PER_FOLDER = 2000  # SpecForge's prepare_hidden_states.py layout: rows_{g}-{g+2000}/
#: how many files are written between two saves of the export index (bounds the rework after a crash)
INDEX_SAVE_EVERY = 256

_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ExportError(TrainingSetError):
    """An export cannot be written; the message names the export and the dataset version."""


class ExportUnsupported(ExportError):
    """The dataset version lacks what the trainer's format needs (e.g. a pre-norm final state)."""


@dataclass(frozen=True)
class PerSampleFileExport:
    """A trainer format with one torch.save file per sample."""

    name: str
    suffixes: tuple[str, ...]                         # file endings the trainer's reader collects
    file_name: Callable[[str, int], str]              # (sample_key, stable number) -> path under the export
    payload: Callable[[dict, str, DatasetInfo], dict]  # (loader item, source_id, info) -> the file's dict
    check: Callable[[DatasetInfo], None]


# --------------------------------------------------------------------------- SpecForge


def _specforge_file(sample_key: str, idx: int) -> str:
    group = idx // SPECFORGE_ROWS_PER_FOLDER * SPECFORGE_ROWS_PER_FOLDER
    return f"rows_{group}-{group + SPECFORGE_ROWS_PER_FOLDER}/data_{idx}.ckpt"


def _specforge_payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    # specforge/algorithms/eagle3/data.py normalize_offline_sample reads these keys and squeezes dim 0.
    return {"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
            "aux_hidden_state": item["aux_hidden_states"].unsqueeze(0),
            "hidden_state": item["hidden_states"].unsqueeze(0)}


def _specforge_check(info: DatasetInfo) -> None:
    # SpecForge's TargetHead applies lm_head alone (no final norm) to hidden_state.
    if info.final_norm != FINAL_NORM:
        raise ExportUnsupported(f"specforge export of dataset version {info.fingerprint}: SpecForge computes the "
                                f"target logits as lm_head(hidden_state) and needs the post-norm final state; "
                                f"this version holds final_norm={info.final_norm!r}")


# --------------------------------------------------------------------------- ModelOpt


def _modelopt_file(sample_key: str, idx: int) -> str:
    stem = sample_key if _SAFE_NAME.fullmatch(sample_key) else safe_rid(sample_key)
    return f"{stem}.pt"


def _modelopt_payload(item: dict, source_id: str, info: DatasetInfo) -> dict:
    # modelopt/torch/speculative/eagle/utils.py OfflineSupervisedDataset; torch.load(weights_only=True)
    # accepts these (tensors, str, bool).
    return {"input_ids": item["input_ids"], "hidden_states": item["hidden_states"],
            "aux_hidden_states": item["aux_hidden_states"], "loss_mask": item["loss_mask"],
            "conversation_id": source_id, "hidden_states_prenorm": info.final_norm != FINAL_NORM}


def _modelopt_check(info: DatasetInfo) -> None:
    if info.final_norm not in (FINAL_NORM, "pre_norm"):
        raise ExportUnsupported(f"modelopt export of dataset version {info.fingerprint}: unknown "
                                f"final_norm={info.final_norm!r}")


# --------------------------------------------------------------------------- speculators


def _speculators_check(info: DatasetInfo) -> None:
    # speculators/models/eagle3/core.py: targets = verifier_lm_head(verifier_norm(verifier_last_hidden_states)),
    # i.e. its trainer applies the final norm itself. Our dumps hold the state after the norm; norming it
    # twice gives wrong target logits (the mismatch of speculators PR #313), and relabelling it as pre-norm
    # would mislead every other reader of that format. So there is no speculators export of such data.
    raise ExportUnsupported(
        f"speculators export of dataset version {info.fingerprint}: speculators stores the final layer's state "
        f"BEFORE the model's final norm and its trainer applies the norm; this version holds "
        f"final_norm={info.final_norm!r} states that cannot be un-normed. Use the 'specforge' or 'modelopt' "
        f"export, which take the post-norm state")


EXPORTS: dict[str, PerSampleFileExport] = {
    "specforge": PerSampleFileExport("specforge", (".ckpt", ".ckpt.gz"), _specforge_file, _specforge_payload,
                                     _specforge_check),
    "modelopt": PerSampleFileExport("modelopt", (".pt",), _modelopt_file, _modelopt_payload, _modelopt_check),
}
#: formats known by name so that asking for one explains why this data cannot be had in it
REFUSED_EXPORTS: dict[str, Callable[[DatasetInfo], None]] = {"speculators": _speculators_check}


def check_exports(names: Sequence[str], info: DatasetInfo) -> None:
    """Raise before any work if an export is unknown or cannot be made from data described by ``info``."""
    for name in names:
        if name in REFUSED_EXPORTS:
            REFUSED_EXPORTS[name](info)
        if name not in EXPORTS:
            raise ExportError(f"unknown export {name!r} for dataset version {info.fingerprint}; "
                              f"known: {sorted(EXPORTS)}")
        EXPORTS[name].check(info)


def run_export(name: str, version_dir: Path) -> ExportSummary:
    """Bring ``{version_dir}/exports/{name}/`` in line with the version's manifest."""
    dataset = TrainingSetDataset(version_dir)
    check_exports([name], dataset.info)
    return export_per_sample_files(EXPORTS[name], dataset)


def aux_layer_ids_output_convention(info: DatasetInfo) -> list[int]:
    """The aux taps as SpecForge/ModelOpt configure them: output of layer k = HF hidden_states[k + 1]."""
    return [i - 1 for i in info.layer_ids]


# --------------------------------------------------------------------------- the incremental writer


def export_per_sample_files(export: PerSampleFileExport, dataset: TrainingSetDataset) -> ExportSummary:
    out = dataset.version_dir / "exports" / export.name
    out.mkdir(parents=True, exist_ok=True)
    info = dataset.info
    index = _load_index(out, export.name, info)
    entries: dict[str, dict] = index["samples"]
    keys = dataset.manifest["sample_key"].to_list()
    hashes = dataset.manifest["content_hash"].to_list()
    source_ids = dataset.manifest["source_id"].to_list()
    for key in keys:  # manifest order is sorted by key, so new numbers do not depend on shard order
        if key not in entries:
            idx = index["next_idx"]
            index["next_idx"] += 1
            entries[key] = {"idx": idx, "file": export.file_name(key, idx), "content_hash": None, "bytes": None}
    present = set(keys)
    for key, entry in entries.items():
        if key not in present:  # the number stays reserved for the key; its file goes
            entry.update(content_hash=None, bytes=None)
    wanted = {entries[k]["file"] for k in keys}
    removed = _remove_stale(out, export.suffixes, wanted)
    _save_index(out, index)

    written = unchanged = 0
    for i, (key, want_hash, source_id) in enumerate(zip(keys, hashes, source_ids)):
        entry = entries[key]
        path = out / entry["file"]
        if entry["content_hash"] == want_hash and _size(path) == entry["bytes"]:
            unchanged += 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save(export.payload(dataset[i], source_id, info), path)
        entry.update(content_hash=want_hash, bytes=path.stat().st_size)
        written += 1
        if written % INDEX_SAVE_EVERY == 0:
            _save_index(out, index)
    _save_index(out, index)
    return ExportSummary(export.name, str(out), len(keys), written, unchanged, removed)


def _load_index(out: Path, name: str, info: DatasetInfo) -> dict:
    path = out / EXPORT_INDEX_NAME
    fresh = {"format": EXPORT_INDEX_FORMAT, "export": name, "fingerprint": info.fingerprint,
             "final_norm": info.final_norm, "dtype": info.dtype, "layer_ids": info.layer_ids,
             "layer_convention": info.layer_convention,
             "eagle_aux_hidden_state_layer_ids": aux_layer_ids_output_convention(info),
             "next_idx": 0, "samples": {}}
    if not path.exists():
        return fresh
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{name} export index {path} is unreadable ({exc}); delete the folder {out} to rebuild it") from exc
    if index.get("format") != EXPORT_INDEX_FORMAT or index.get("export") != name \
            or index.get("fingerprint") != info.fingerprint:
        raise ExportError(f"{path} is not the {name} export index of dataset version {info.fingerprint} "
                          f"(format {index.get('format')!r}, export {index.get('export')!r}, "
                          f"version {index.get('fingerprint')!r})")
    return index


def _save_index(out: Path, index: dict) -> None:
    path = out / EXPORT_INDEX_NAME
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale(out: Path, suffixes: tuple[str, ...], wanted: set[str]) -> int:
    """Delete trainer files no sample wants, leftover temporaries and emptied folders; returns trainer files deleted."""
    removed = 0
    for path in sorted(out.rglob("*"), reverse=True):  # children before their folders
        rel = path.relative_to(out).as_posix()
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        elif rel.endswith(suffixes) and rel not in wanted:
            path.unlink()
            removed += 1
        elif path.name.startswith(".") and path.name.endswith(".tmp"):  # a write killed before its rename
            path.unlink()
    return removed


def _atomic_torch_save(obj: dict, path: Path) -> None:
    # The temporary name ends in .tmp, which no trainer's reader collects.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        torch.save(obj, tmp)  # zip serialisation: SpecForge reads with torch.load(mmap=True)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None
