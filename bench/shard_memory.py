"""The client's peak memory against the batch size: samples streamed into the shard, or held.

    python -m bench.shard_memory [--batch-sizes 10 100 1000] [--hidden 1024] [--tokens 128]

One transformers-engine server (a random model of ``--hidden`` width, 4 layers and a narrow MLP,
so that the hidden states, not the compute, are what is big); per batch size, a fresh client process
extracts one batch into one shard, two ways:

- streamed: ``tasks.retrieval.extract_batch``, what the flow runs: each verified sample goes
  straight into its place in the shard (``tasks.shards.ShardWriter``) and is dropped;
- held: the batch collected in memory and written with ``write_shard`` at the end, as the
  flow did before (kept here as the baseline).

Columns: the batch's hidden-state bytes, the client's peak RSS (``ru_maxrss``) each way, and
the shard's size. Streamed, the peak should stay flat as the batch grows; held, it grows with it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.benchmark import RID_PREFIX
from infra.server import ServerConfig, start_server
from infra.tiny_model import build_tiny_model
from patches.dumps import DumpReader
from tasks.dataset_version import ModelFacts, read_model_facts
from tasks.retrieval import (ExpectedDump, InFlightLimit, RetrievalSettings, extract_batch, extract_samples,
                             keep_samples)
from tasks.samples import PreparedSample
from tasks.shards import write_shard

IN_FLIGHT = 8
AUX_LAYERS = (1, 2, 3)  # of 4 layers: fewer layers than the EAGLE-3 default needs, less compute


def random_samples(n: int, tokens: int, vocab: int, seed: int) -> list[PreparedSample]:
    g = torch.Generator().manual_seed(seed)
    return [PreparedSample(f"mem{seed}-{i:06d}", f"mem-{i}", i + 1, torch.randint(10, vocab, (tokens,), generator=g)
                           .tolist(), [0] * (tokens // 2) + [1] * (tokens - tokens // 2), False) for i in range(n)]


def client(args) -> None:
    """One batch, one way; prints a JSON line with the peak RSS."""
    facts = read_model_facts(args.model_path)
    settings = RetrievalSettings(url=args.url, rid_prefix=RID_PREFIX,
                                 expected=ExpectedDump(AUX_LAYERS, facts.hidden_size, "float32"))
    samples = random_samples(args.batch_size, args.tokens, facts.vocab_size, seed=args.batch_size)
    reader, limit = DumpReader(args.dump_dir), InFlightLimit(IN_FLIGHT, 1 << 40)
    t0 = time.monotonic()
    if args.mode == "streamed":
        shard, failed = extract_batch(settings, reader, samples, limit, args.shard)
    else:
        held = []
        failed = extract_samples(settings, reader, samples, limit, keep_samples(settings.expected, reader, held.append))
        shard = write_shard(args.shard, held)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "shard_mb": shard.bytes / 1e6, "failed": len(failed), "wall_s": time.monotonic() - t0}))


def measure(args, work: Path) -> tuple[list[dict], ModelFacts]:
    """One server; per batch size a streamed and a held client. Returns the rows and the model's facts."""
    model_path = build_tiny_model(work / "model", layers=4, hidden=args.hidden, intermediate=64,
                                  heads=args.hidden // 64, kv_heads=args.hidden // 128)
    facts = read_model_facts(model_path)
    per_token = 8 + (len(AUX_LAYERS) + 2) * facts.hidden_size * 4
    server = start_server(ServerConfig(model_path=model_path, dump_dir=work / "dumps", rid_prefix=RID_PREFIX,
                                       aux_layer_ids=AUX_LAYERS), work / "server.log")
    rows = []
    try:
        for n in args.batch_sizes:
            row = {"batch": n, "hidden_gb": n * args.tokens * per_token / 1e9}
            for mode in ("streamed", "held"):
                shard = work / f"{mode}-{n}.safetensors"
                out = subprocess.run([sys.executable, "-m", "bench.shard_memory", "--client", "--mode", mode,
                                      "--url", server.url, "--model-path", str(model_path), "--dump-dir",
                                      str(work / "dumps"), "--shard", str(shard), "--batch-size", str(n),
                                      "--tokens", str(args.tokens)], capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"the {mode} client of batch {n} exited {out.returncode}:\n{out.stderr[-3000:]}")
                result = json.loads(out.stdout.splitlines()[-1])
                if result["failed"]:
                    raise RuntimeError(f"{result['failed']} samples failed in the {mode} batch of {n}")
                row[mode] = result
                shard.unlink()
            rows.append(row)
    finally:
        server.stop()
    return rows, facts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    for name in ("--mode", "--url"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--model-path", "--dump-dir", "--shard"):
        ap.add_argument(name, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client(args)

    with tempfile.TemporaryDirectory(prefix="eagle3-memory-") as folder:
        rows, facts = measure(args, Path(folder))
    print(f"hidden {facts.hidden_size}, {facts.num_layers} layers, fp32, {args.tokens} tokens a sample, "
          f"{IN_FLIGHT} in flight, torch {torch.__version__}")
    print("| batch | hidden states (GB) | peak RSS streamed (MB) | peak RSS held (MB) | shard (MB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['hidden_gb']:.2f} | {r['streamed']['peak_rss_mb']:,.0f} | "
              f"{r['held']['peak_rss_mb']:,.0f} | {r['streamed']['shard_mb']:,.0f} |")


if __name__ == "__main__":
    main()
