"""The draft vocabulary mapping: which target tokens the draft's lm_head predicts.

EAGLE-3 drafts predict over a smaller vocabulary than the target's (commonly 32000); the
mapping keeps the target tokens most often supervised in the dataset version. Written at
consolidation into the version folder, in the trainers' own forms, counted over the whole
manifest each time (so it follows the version as it grows)::

    vocab_mapping.pt   SpecForge (--vocab-mapping; DraftModel.load_vocab_mapping copies it into its
                       buffers): {"d2t": int64 [N], "t2d": bool [V]}. d2t[i] = target_id - i for
                       the draft's i-th token (the N kept ids in ascending order); t2d[t] is True
                       for the N kept target ids.
    token_freq.pt      speculators (<data-path>/token_freq.pt, --token-freq-path): {target_id: count}
                       over supervised tokens (loss_mask 1), the ids that occur only.

The N ids: by count, ties to the lower id, then the lowest unused ids when fewer than N
distinct tokens are supervised -- speculators' build_vocab_mappings_from_distribution.
SpecForge's process_token_dict_to_mappings picks the same ids except among tied counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from safetensors import SafetensorError, safe_open

from tasks.shards import ShardCorrupt, TrainingSetError
from tasks.training_set import DatasetInfo, atomic_write

DEFAULT_DRAFT_VOCAB_SIZE = 32000
VOCAB_MAPPING_NAME = "vocab_mapping.pt"
TOKEN_FREQ_NAME = "token_freq.pt"


@dataclass(frozen=True)
class VocabMappingSummary:
    draft_vocab_size: int
    target_vocab_size: int
    supervised_tokens: int
    distinct_supervised: int   # distinct target ids among the supervised tokens
    coverage: float            # share of the supervised tokens whose id is in the draft vocabulary
    files: dict[str, str]      # trainer -> file name in the version folder


def draft_vocab_size_for(info: DatasetInfo, requested: int | None) -> int:
    """``requested``, or the default: 32000, or the target's vocabulary when smaller."""
    size = min(DEFAULT_DRAFT_VOCAB_SIZE, info.vocab_size) if requested is None else requested
    if not 1 <= size <= info.vocab_size:
        raise TrainingSetError(f"draft vocabulary size {size} for dataset version {info.fingerprint}: must be in "
                               f"1..{info.vocab_size}, the target model's vocabulary")
    return size


def count_supervised_tokens(version_dir: Path, manifest: pl.DataFrame, vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each target id is supervised in the manifest's samples.

    Reads the shards' input_ids and loss_mask columns only; rows of a shard that are not the
    manifest's (a duplicate, a sample left out) do not count.
    """
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for (shard,), rows in manifest.group_by("shard"):
        path = Path(version_dir) / "shards" / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool()
        except (SafetensorError, OSError) as exc:
            raise ShardCorrupt(f"shard {path} of the manifest: cannot read input_ids and loss_mask: {exc}") from exc
        in_manifest = torch.zeros_like(mask)
        for start, end in zip(rows["offset_start"].to_list(), rows["offset_end"].to_list()):
            in_manifest[start:end] = True
        supervised = ids[mask & in_manifest]
        if supervised.numel() and not 0 <= int(supervised.min()) <= int(supervised.max()) < vocab_size:
            raise TrainingSetError(f"shard {path}: supervised token ids span {int(supervised.min())}.."
                                   f"{int(supervised.max())}, outside the target vocabulary 0..{vocab_size - 1}")
        counts += torch.bincount(supervised, minlength=vocab_size)
    return counts


def vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) from per-id counts; see the module docstring for the choice of ids."""
    # A stable sort of -counts keeps ascending ids among ties, and the never-seen ids (count 0)
    # come after every seen one in ascending order: the padding rule too.
    order = torch.sort(-counts, stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def write_vocab_mapping(version_dir: Path, manifest: pl.DataFrame, info: DatasetInfo,
                        draft_vocab_size: int | None = None) -> VocabMappingSummary:
    """Count the manifest's supervised tokens; write vocab_mapping.pt and token_freq.pt atomically."""
    version_dir = Path(version_dir)
    size = draft_vocab_size_for(info, draft_vocab_size)
    counts = count_supervised_tokens(version_dir, manifest, info.vocab_size)
    d2t, t2d = vocab_mapping(counts, size)
    seen = torch.nonzero(counts).flatten()
    token_freq = dict(zip(seen.tolist(), counts[seen].tolist()))
    atomic_write(version_dir / VOCAB_MAPPING_NAME, lambda tmp: torch.save({"d2t": d2t, "t2d": t2d}, tmp))
    atomic_write(version_dir / TOKEN_FREQ_NAME, lambda tmp: torch.save(token_freq, tmp))
    total = int(counts.sum())
    return VocabMappingSummary(draft_vocab_size=size, target_vocab_size=info.vocab_size, supervised_tokens=total,
                               distinct_supervised=len(token_freq),
                               coverage=round(int(counts[t2d].sum()) / total, 6) if total else 0.0,
                               files={"specforge": VOCAB_MAPPING_NAME, "speculators": TOKEN_FREQ_NAME})
