"""Consolidation: a dataset version's shards become its manifest, metadata, vocabulary mapping and exports.

Composition only: the layout is tasks.training_set's, the exports tasks.exports', the
mapping tasks.vocab_mapping's. Order, so that dataset.json never names a file that is not on
disk, nor an export out of line with the manifest, whenever the consolidation stops: exports
unlisted, the manifest, the vocabulary files, dataset.json (no exports listed), then each export,
which lists itself in dataset.json once its files are written. Each file is replaced by a rename.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl

from tasks.exports import ExportSummary, check_exports, run_export
from tasks.shards import TrainingSetError, list_shards, read_shard_index, read_shard_layout
from tasks.training_set import DATASET_INFO_NAME, MANIFEST_NAME, MANIFEST_SCHEMA, DatasetInfo, atomic_write, \
    read_dataset_json, sample_bytes, write_dataset_json
from tasks.vocab_mapping import VocabMappingSummary, write_vocab_mapping


class SchemaMismatch(TrainingSetError):
    """Shards of one version disagree with the version's DatasetInfo (dtype, widths)."""


class MissingSamples(TrainingSetError):
    """Samples the caller wants in the dataset are in no shard."""


@dataclass(frozen=True)
class ConsolidationSummary:
    version_dir: str
    samples: int
    tokens: int
    supervised_tokens: int
    bytes: int            # tensor bytes of the manifest's samples (what a trainer reads)
    shards: int
    duplicates: int       # sample copies in more than one shard, left out of the manifest
    left_out: int         # samples in shards but not in keep_keys
    vocab_mapping: VocabMappingSummary | None = None
    exports: dict[str, ExportSummary] = field(default_factory=dict)


def consolidate(version_dir: Path, info: DatasetInfo, keep_keys: set[str] | None = None,
                exports: Sequence[str] = (), draft_vocab_size: int | None = None,
                index_rows: list[dict] | None = None) -> ConsolidationSummary:
    """Build the manifest, the vocabulary mapping and dataset.json from the version's shards, then the exports.

    ``keep_keys``: the samples of the dataset (None: every sample in the shards); samples in
    shards but not in it are left out of the manifest and the exports, their shards untouched.
    ``draft_vocab_size``: None for the default (tasks.vocab_mapping). Each export is checked
    against ``info`` before anything is written. ``index_rows``: the shards' index rows
    (``read_shard_index``) when the shards are elsewhere (on a GPU node, ``--shards-on node``);
    the manifest is built from them, and neither the vocabulary mapping nor an export can be
    made until the shards are fetched.
    """
    version_dir = Path(version_dir)
    check_exports(exports, info)
    if index_rows is not None and exports:
        raise TrainingSetError(f"{version_dir}: exports {list(exports)} need the shards here; fetch them first")
    rows = index_rows
    if rows is None:
        rows = []
        for shard in list_shards(version_dir):
            _check_layout(shard, info)
            rows.extend(read_shard_index(shard))
    found = pl.DataFrame(rows, schema=MANIFEST_SCHEMA)
    unique = found.unique(subset="sample_key", keep="first", maintain_order=True)  # shards are in name order
    if keep_keys is None:
        manifest = unique
    else:
        manifest = unique.filter(pl.col("sample_key").is_in(list(keep_keys)))
        missing = set(keep_keys) - set(manifest["sample_key"].to_list())
        if missing:
            raise MissingSamples(f"{version_dir}: {len(missing)} of the {len(keep_keys)} samples to keep are in no "
                                 f"shard, e.g. {sorted(missing)[:3]}")
    manifest = manifest.sort("sample_key")
    tokens = int(manifest["num_tokens"].sum())
    supervised = int(manifest["num_supervised"].sum())

    if (version_dir / DATASET_INFO_NAME).exists():
        listed = read_dataset_json(version_dir)
        if listed.get("exports"):  # in line with the manifest about to be replaced: not any more
            write_dataset_json(version_dir, {**listed, "exports": []})
    atomic_write(version_dir / MANIFEST_NAME, manifest.write_parquet)
    vocab = None if index_rows is not None else write_vocab_mapping(version_dir, manifest, info, draft_vocab_size)
    summary = ConsolidationSummary(
        version_dir=str(version_dir), samples=manifest.height, tokens=tokens, supervised_tokens=supervised,
        bytes=sample_bytes(tokens, info), shards=manifest["shard"].n_unique(),
        duplicates=found.height - unique.height, left_out=unique.height - manifest.height, vocab_mapping=vocab)
    write_dataset_json(version_dir, {
        **asdict(info), "samples": summary.samples, "tokens": tokens, "supervised_tokens": supervised,
        "bytes": summary.bytes, "shards": sorted(set(manifest["shard"].to_list())),
        "vocab_mapping": None if vocab is None else asdict(vocab), "exports": []})
    done = {name: run_export(name, version_dir) for name in exports}
    return ConsolidationSummary(**{**asdict(summary), "vocab_mapping": vocab, "exports": done})


def _check_layout(shard: Path, info: DatasetInfo) -> None:
    layout = read_shard_layout(shard)
    want = {"dtype": info.dtype, "store_dtype": info.store_dtype, "hidden_size": info.hidden_size,
            "aux_width": len(info.layer_ids) * info.hidden_size}
    if layout != want:
        raise SchemaMismatch(f"shard {shard} holds {layout}; dataset version {info.fingerprint} expects {want}")
