"""The incremental writer of per-sample-file trainer exports, and the export index.

An export lives in ``{version_dir}/exports/{name}/`` and reads the samples through
``TrainingSetDataset`` (tasks.training_set holds the schema); nothing here defines a second
layout of our data. Each file holds exactly its sample's tensors (the loader hands out
copies of the sample's rows, never views of a shard).

Incremental: a file whose recorded content hash matches the manifest's and whose size is
unchanged is left alone; samples that left the manifest lose their files; files the index
does not account for (a crash between a file's rename and its index line) are removed or
rewritten. Numbered formats (SpecForge) assign a sample's number once and keep it, also
while the sample is out of the manifest: numbering by position in the manifest would hand
the same file name to another sample whenever one is added or removed, the resume bug of
ModelOpt PR #2080 and SpecForge PR #295.

The export index ``export_index.jsonl`` is an append-only log, one JSON object a line:

    line 1     the header: format, export, the dataset version's fingerprint, final_states,
               dtype, layer_ids (HF hidden_states indices) and eagle_aux_hidden_state_layer_ids
               (the same taps as SpecForge/ModelOpt configure them: output of layer k = i - 1)
    then       {"key", "idx", "file", "content_hash", "bytes"}: appended after the file is
               renamed into place; content_hash and bytes null: appended before the file is
               deleted. A key's last line is its state.

So the index never claims a file that is not on disk. A line cut short by a crash is
dropped when the index is read. Appending costs the same per file at any dataset size; the
log is rewritten whole (atomically) only when superseded lines outnumber the live ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tasks.shards import TrainingSetError
from tasks.training_set import DatasetInfo, TrainingSetDataset, atomic_write

EXPORT_INDEX_NAME = "export_index.jsonl"
EXPORT_INDEX_FORMAT = "eagle3-export-index"
EXPORT_INDEX_VERSION = 2  # 1 was export_index.json, rewritten whole


class ExportError(TrainingSetError):
    """An export cannot be written; the message names the export and the dataset version."""


class ExportUnsupported(ExportError):
    """The dataset version lacks what the trainer's format needs (e.g. a pre-norm final state)."""


def require_final_state(export: str, info: DatasetInfo, state: str, why: str) -> None:
    """Raise ExportUnsupported unless the version's samples hold the final state ``state`` ("post_norm", "pre_norm")."""
    if state not in info.final_states.split("+"):
        raise ExportUnsupported(f"{export} export of dataset version {info.fingerprint}: {why}; this version holds "
                                f"final_states={info.final_states!r}")


@dataclass(frozen=True)
class ExportSummary:
    name: str
    path: str
    samples: int
    written: int
    unchanged: int
    removed: int


def _torch_save(payload: dict, path: Path) -> None:
    torch.save(payload, path)


@dataclass(frozen=True)
class PerSampleFileExport:
    """A trainer format with one file per sample (torch.save unless ``save`` says otherwise)."""

    name: str
    suffixes: tuple[str, ...]                         # file endings the trainer's reader collects
    file_name: Callable[[str, int], str]              # (sample_key, stable number) -> path under the export
    payload: Callable[[dict, str, DatasetInfo], dict]  # (loader item, source_id, info) -> the file's dict
    check: Callable[[DatasetInfo], None]              # raises ExportUnsupported for data the format cannot take
    save: Callable[[dict, Path], None] = _torch_save  # writes a payload to a path
    #: after the per-sample files: what the format keeps beside them (speculators' row table)
    finish: Callable[["ExportIndex", TrainingSetDataset], None] | None = None


def aux_layer_ids_output_convention(info: DatasetInfo) -> list[int]:
    """The aux taps as SpecForge/ModelOpt configure them: output of layer k = HF hidden_states[k + 1]."""
    return [i - 1 for i in info.layer_ids]


def write_per_sample_files(export: PerSampleFileExport, dataset: TrainingSetDataset) -> ExportSummary:
    out = dataset.version_dir / "exports" / export.name
    out.mkdir(parents=True, exist_ok=True)
    info = dataset.info
    keys = dataset.manifest["sample_key"].to_list()
    hashes = dataset.manifest["content_hash"].to_list()
    source_ids = dataset.manifest["source_id"].to_list()
    with ExportIndex.load(out, export.name, info) as index:
        next_idx = index.next_idx()
        planned: dict[str, tuple[int, str]] = {}
        for key in keys:  # manifest order is sorted by key, so new numbers do not depend on shard order
            entry = index.entries.get(key)
            if entry is None:
                planned[key] = (next_idx, export.file_name(key, next_idx))
                next_idx += 1
            else:
                planned[key] = (entry["idx"], entry["file"])
        present = set(keys)
        for key, entry in list(index.entries.items()):
            if key not in present and entry["content_hash"] is not None:
                index.record(key, entry["idx"], entry["file"], None, None)  # retract, then delete
        removed = _remove_stale(out, export.suffixes, {file for _, file in planned.values()})

        written = unchanged = 0
        for i, (key, want_hash, source_id) in enumerate(zip(keys, hashes, source_ids)):
            idx, file = planned[key]
            path = out / file
            entry = index.entries.get(key)
            if entry is not None and entry["content_hash"] == want_hash and _size(path) == entry["bytes"]:
                unchanged += 1
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                atomic_write(path, lambda tmp: export.save(export.payload(dataset[i], source_id, info), tmp))
            except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
                raise ExportError(f"{export.name} export of dataset version {info.fingerprint}: cannot write "
                                  f"sample {key!r} to {path}: {exc}") from exc
            index.record(key, idx, file, want_hash, path.stat().st_size)
            written += 1
        if export.finish is not None:
            export.finish(index, dataset)
    return ExportSummary(export.name, str(out), len(keys), written, unchanged, removed)


class ExportIndex:
    """The export_index.jsonl log of one export folder (see the module docstring)."""

    def __init__(self, out: Path, header: dict, entries: dict[str, dict], lines: int):
        self.path = out / EXPORT_INDEX_NAME
        self.header = header
        self.entries = entries  # key -> {"idx", "file", "content_hash", "bytes"}: the key's last line
        self._lines = lines
        self._file = None

    @classmethod
    def load(cls, out: Path, name: str, info: DatasetInfo) -> "ExportIndex":
        header = {"format": EXPORT_INDEX_FORMAT, "version": EXPORT_INDEX_VERSION, "export": name,
                  "fingerprint": info.fingerprint, "final_states": info.final_states, "dtype": info.dtype,
                  "layer_ids": info.layer_ids, "layer_convention": info.layer_convention,
                  "eagle_aux_hidden_state_layer_ids": aux_layer_ids_output_convention(info)}
        path = out / EXPORT_INDEX_NAME
        if not path.exists():
            index = cls(out, header, {}, 0)
            index._compact()
            return index
        try:
            raw = path.read_bytes().decode()
        except (OSError, UnicodeDecodeError) as exc:
            raise ExportError(f"{name} export index {path} is unreadable ({exc}); delete the folder {out} "
                              f"to rebuild it") from exc
        lines = raw.split("\n")
        torn = lines[-1] != ""  # a crash cut the last append short: that file is not accounted for
        lines = lines[:-1]
        try:
            found = json.loads(lines[0]) if lines else {}
            records = [json.loads(line) for line in lines[1:]]
        except ValueError as exc:
            raise ExportError(f"{name} export index {path} has a corrupt line ({exc}); delete the folder {out} "
                              f"to rebuild it") from exc
        if {k: found.get(k) for k in ("format", "version", "export", "fingerprint")} != \
                {k: header[k] for k in ("format", "version", "export", "fingerprint")}:
            raise ExportError(f"{path} is not the {name} export index of dataset version {info.fingerprint} "
                              f"(format {found.get('format')!r} version {found.get('version')!r}, export "
                              f"{found.get('export')!r}, dataset version {found.get('fingerprint')!r})")
        entries: dict[str, dict] = {}
        for r in records:
            entries[r["key"]] = {"idx": r["idx"], "file": r["file"], "content_hash": r["content_hash"],
                                 "bytes": r["bytes"]}
        index = cls(out, header, entries, len(records))
        if torn or index._lines > 2 * len(entries) + 1024:
            index._compact()
        return index

    def next_idx(self) -> int:
        return max((e["idx"] for e in self.entries.values()), default=-1) + 1

    def record(self, key: str, idx: int, file: str, content_hash: str | None, size: int | None) -> None:
        entry = {"idx": idx, "file": file, "content_hash": content_hash, "bytes": size}
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps({"key": key, **entry}) + "\n")
        self._file.flush()
        self.entries[key] = entry
        self._lines += 1

    def forget_retracted(self) -> None:
        """Drop the lines of samples that left the manifest (their numbers become free); rewrites the log."""
        if self._file is not None:  # the rewrite replaces the file this handle appends to
            self._file.close()
            self._file = None
        self.entries = {k: e for k, e in self.entries.items() if e["content_hash"] is not None}
        self._compact()

    def _compact(self) -> None:
        lines = [json.dumps(self.header)] + [json.dumps({"key": k, **e}) for k, e in self.entries.items()]
        atomic_write(self.path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))
        self._lines = len(self.entries)

    def __enter__(self) -> "ExportIndex":
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None
