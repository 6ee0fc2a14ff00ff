"""Bytes per token and reconstruction error of a quantized store against the same samples unquantized.

    python -m flows.extract --dtype bfloat16 --out out
    python -m flows.extract --dtype bfloat16 --store-dtype float8_e4m3fn --out out
    python -m bench.store_dtype out/versions/<bf16 fingerprint> out/versions/<fp8 fingerprint>

Both versions must hold the same samples. Errors are per token and per layer (each aux layer
and the final state: a vector of H values): relative error ||q - r|| / ||r||, and cosine
similarity, over every token of every sample; printed as a markdown table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tasks.training_set import TrainingSetDataset, read_dataset_json


def shard_bytes(version_dir: Path) -> int:
    return sum(p.stat().st_size for p in (version_dir / "shards").glob("*.safetensors"))


def compare(reference: Path, quantized: Path) -> tuple[list[float], list[float]]:
    ref, quant = TrainingSetDataset(reference), TrainingSetDataset(quantized)
    keys = ref.manifest["sample_key"].to_list()
    if quant.manifest["sample_key"].to_list() != keys:
        raise SystemExit(f"{reference} and {quantized} do not hold the same samples")
    hidden = ref.info.hidden_size
    rel, cos = [], []
    for i in range(len(keys)):
        r, q = ref[i], quant[i]
        if not torch.equal(r["input_ids"], q["input_ids"]):
            raise SystemExit(f"sample {keys[i]}: other token ids in the two versions")
        for name in ("aux_hidden_states", "hidden_states", "prenorm_hidden_states"):
            a = r[name].float().reshape(-1, hidden)
            b = q[name].float().reshape(-1, hidden)
            rel.append((b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30))
            cos.append(torch.nn.functional.cosine_similarity(a, b, dim=-1))
    return torch.cat(rel).tolist(), torch.cat(cos).tolist()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.store_dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", type=Path)
    p.add_argument("quantized", type=Path)
    a = p.parse_args(argv)
    rel, cos = compare(a.reference, a.quantized)
    print("| store | shard bytes/token | rel. error mean | rel. error max | cosine mean | cosine min |")
    print("|---|---|---|---|---|---|")
    for path, errors in ((a.reference, None), (a.quantized, (rel, cos))):
        data = read_dataset_json(path)
        cells = ("0", "0", "1", "1") if errors is None else (
            f"{sum(rel) / len(rel):.4f}", f"{max(rel):.4f}", f"{sum(cos) / len(cos):.6f}", f"{min(cos):.6f}")
        print(f"| {data['store_dtype']} | {shard_bytes(path) / data['tokens']:,.1f} | " + " | ".join(cells) + " |")
    print(f"\n{len(rel):,} vectors (tokens x (aux layers + both final states)), {read_dataset_json(a.reference)['tokens']:,} tokens")


if __name__ == "__main__":
    main()
