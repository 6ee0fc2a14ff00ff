"""Accounting from the files: at the end of a run, every input row is found on disk exactly once.

The counts a run reports are read back from what it wrote, not derived from each other:

* each sample of the input (a row that was neither rejected nor a duplicate) has exactly one
  row in ``manifest.parquet`` or one entry in the run record's ``failed`` list, not both;
* the manifest names no sample that is not in the input, and each of its rows points at a
  shard on disk whose header holds that sample at those rows with that content hash
  (checked when the shards are here, not on a node);
* each duplicate's sample is in the manifest or failed (it is written once, under the first id);
* ``rejects.jsonl`` lists exactly the rejected input lines.

A missing or extra sample is an :class:`AccountingError` that names it.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tasks.prompts import PreparedPrompts
from tasks.shards import TrainingSetError, read_shard_index
from tasks.training_set import MANIFEST_NAME, read_manifest

#: problems named in the error message (all of them are counted)
SHOWN_PROBLEMS = 10


class AccountingError(TrainingSetError):
    """The files of a dataset version disagree with the run's input; ``problems`` names each sample."""

    def __init__(self, version_dir: Path | str, problems: list[str]):
        self.version_dir, self.problems = str(version_dir), problems
        shown = "; ".join(problems[:SHOWN_PROBLEMS])
        more = f"; and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        super().__init__(f"{version_dir}: {len(problems)} accounting problems: {shown}{more}")


@dataclass(frozen=True)
class Accounting:
    """The run's counts as read from the files."""

    rows_in: int
    written: int      # manifest rows
    failed: int       # entries of the run record's failed list
    duplicates: int
    rejected: int     # lines of rejects.jsonl


def reconcile(version_dir: Path | str, prepared: PreparedPrompts, run_record: Path | str,
              shards_here: bool = True, left_for_later: set[str] = frozenset()) -> Accounting:
    """Check the version's manifest, shards, rejects file and the run record against ``prepared``.
    ``left_for_later``: keys of samples this run did not try (a retry of failed samples only); they
    must be in neither the manifest nor the failures."""
    vdir, run_record = Path(version_dir), Path(run_record)
    problems: list[str] = []
    manifest = read_manifest(vdir)
    rows = manifest.select("sample_key", "source_id", "shard", "offset_start", "offset_end",
                           "content_hash").to_dicts()
    failed = json.loads(run_record.read_text())["failed"]
    rejects_path = vdir / "rejects.jsonl"
    rejected_lines = [json.loads(line)["line"] for line in rejects_path.read_text().splitlines() if line.strip()]

    written = Counter(r["sample_key"] for r in rows)
    failed_keys = Counter(f["sample_key"] for f in failed)
    inputs = {s.sample_key: s for s in prepared.samples}
    for key, sample in inputs.items():
        where = f"sample {sample.source_id!r} (line {sample.line}, key {key[:12]})"
        if key in left_for_later:
            if written[key] or failed_keys[key]:
                problems.append(f"{where} was left for a later run but is in {MANIFEST_NAME} or the failures")
        elif written[key] + failed_keys[key] == 0:
            problems.append(f"{where} is in neither {MANIFEST_NAME} nor the failures of {run_record.name}")
        elif written[key] and failed_keys[key]:
            problems.append(f"{where} is both in {MANIFEST_NAME} and among the failures of {run_record.name}")
    for key, n in written.items():
        if n > 1:
            problems.append(f"sample key {key[:12]} has {n} rows in {MANIFEST_NAME}")
    for row in rows:
        if row["sample_key"] not in inputs:
            problems.append(f"{MANIFEST_NAME} row {row['source_id']!r} (key {row['sample_key'][:12]}) is no sample "
                            f"of the input")
    for f in failed:
        if f["sample_key"] not in inputs:
            problems.append(f"failed sample {f['source_id']!r} in {run_record.name} is no sample of the input")
    for dup in prepared.duplicates:
        if not (written[dup.sample_key] or failed_keys[dup.sample_key] or dup.sample_key in left_for_later):
            problems.append(f"duplicate {dup.source_id!r} (line {dup.line}) of {dup.first_source_id!r}: its sample "
                            f"(key {dup.sample_key[:12]}) is in neither {MANIFEST_NAME} nor the failures")
    want_rejected = sorted(r.line for r in prepared.rejected)
    if sorted(rejected_lines) != want_rejected:
        problems.append(f"{rejects_path} lists lines {sorted(rejected_lines)[:20]}, the input rejected lines "
                        f"{want_rejected[:20]}")
    if shards_here:
        problems += _check_shards(vdir, rows)
    if problems:
        raise AccountingError(vdir, problems)
    return Accounting(rows_in=prepared.rows_in, written=len(rows), failed=len(failed),
                      duplicates=len(prepared.duplicates), rejected=len(rejected_lines))


def _check_shards(vdir: Path, rows: list[dict]) -> list[str]:
    """Each manifest row is in its shard's header, at its rows, with its content hash."""
    problems: list[str] = []
    by_shard: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_shard[row["shard"]].append(row)
    for name, wanted in sorted(by_shard.items()):
        path = vdir / "shards" / name
        if not path.is_file():
            problems += [f"sample {r['source_id']!r} (key {r['sample_key'][:12]}): its shard {path} is missing"
                         for r in wanted]
            continue
        try:
            held = {(r["sample_key"], r["offset_start"], r["offset_end"], r["content_hash"])
                    for r in read_shard_index(path)}
        except TrainingSetError as exc:
            problems.append(f"{len(wanted)} samples, e.g. {wanted[0]['source_id']!r}: {exc}")
            continue
        problems += [f"sample {r['source_id']!r} (key {r['sample_key'][:12]}) is not in {path} at rows "
                     f"{r['offset_start']}:{r['offset_end']} with content hash {r['content_hash']}"
                     for r in wanted
                     if (r["sample_key"], r["offset_start"], r["offset_end"], r["content_hash"]) not in held]
    return problems
