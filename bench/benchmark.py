"""Extraction throughput and overhead, beside the naive way, on the same prompts.

    python -m bench.benchmark [--samples 1000] [--in-flight 1 4 16] [--model-path DIR]

Each row runs on a fresh local server (radix cache on, chunked prefill, warmup) and
checks every sample against a direct transformers forward of the same ids. Columns:
samples/s, tokens/s, pipeline efficiency (server time in forward passes / wall time),
client overhead per sample ((wall - forward time) / samples), mismatched samples.

The naive baseline sends one request at a time, empties the dump folder before each
request and takes the one new dump, as a client that trusts "one request, one dump"
does.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from infra.server import ServerConfig, start_server
from infra.tiny_model import build_tiny_model
from patches.dumps import RID_PREFIX, DumpReader, default_aux_layer_ids
from tasks.dataset_version import read_model_facts
from tasks.chat_template import ChatTemplate, Conversation
from tasks.samples import PreparedSample
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, extract_samples, keep_samples
from tests.ground_truth import load_reference_model, reference_hidden_states

WORDS = ("the model reads every token and the draft learns to guess the next one quickly while "
         "the server batches requests and writes hidden states for each prefill chunk").split()


def make_samples(tokenizer, n: int, seed: int = 0, max_words: int = 120) -> list[PreparedSample]:
    """``n`` two-turn conversations; the assistant says 10 to ``max_words`` words."""
    rng = random.Random(seed)
    template = ChatTemplate(tokenizer)
    samples = []
    for i in range(n):
        def text(k):
            return " ".join(rng.choice(WORDS) for _ in range(k))
        messages = [{"role": "user", "content": f"#{i} " + text(rng.randint(5, max_words // 2))},
                    {"role": "assistant", "content": text(rng.randint(10, max_words))}]
        masked = template.mask(Conversation(messages))
        samples.append(PreparedSample(sample_key=f"bench{i:06d}", source_id=f"bench-{i}", line=i + 1,
                                      input_ids=masked.input_ids, loss_mask=masked.loss_mask, truncated=False))
    return samples


def forward_time(url: str) -> float:
    return float(requests.get(f"{url}/server_info", timeout=10).json()["scheduler"]["forward_time_s"])


def run_core(server, samples, layer_ids, hidden, in_flight) -> list:
    settings = RetrievalSettings(url=server.url, rid_prefix=RID_PREFIX,
                                 expected=ExpectedDump(tuple(layer_ids), hidden, "float32"))
    written = []  # list.append is thread-safe; a benchmark of this size fits in memory
    reader = DumpReader(server.config.dump_dir)
    failed = extract_samples(settings, reader, samples, InFlightLimit(in_flight, 1 << 40),
                             keep_samples(settings.expected, reader, written.append))
    if failed:
        raise RuntimeError(f"{len(failed)} samples failed, first: {failed[0]}")
    order = {s.sample_key: i for i, s in enumerate(samples)}
    return [(s.input_ids.tolist(), s.aux_hidden_states, s.final_hidden_states)
            for s in sorted(written, key=lambda s: order[s.sample_key])]


def run_naive(server, samples, layer_ids, hidden, in_flight) -> list:
    dump_dir = server.config.dump_dir
    out = []
    for s in samples:
        for p in dump_dir.iterdir():
            p.unlink(missing_ok=True)  # the writer may rename its temp file meanwhile
        r = requests.post(f"{server.url}/generate", json={"input_ids": s.input_ids,
                          "rid": f"{RID_PREFIX}{s.sample_key}", "sampling_params": {"max_new_tokens": 1}}, timeout=60)
        r.raise_for_status()
        deadline = time.monotonic() + 10
        files: list[Path] = []
        while not files and time.monotonic() < deadline:
            time.sleep(0.001)  # a bare spin would take a core from the server on a 2-core machine
            files = [p for p in dump_dir.iterdir() if p.name.endswith(".safetensors") and not p.name.startswith(".")]
        newest = max(files, key=lambda p: p.stat().st_mtime_ns)
        t = load_file(newest)
        out.append((s.input_ids, t["aux_hidden_states"], t["final_hidden_states"]))
    return out


def count_mismatches(results, samples, model, layer_ids) -> int:
    by_ids = {tuple(s.input_ids): s for s in samples}
    bad = len(samples) - len(results)
    for ids, aux, final in results:
        if tuple(ids) not in by_ids:
            bad += 1
            continue
        ref_aux, ref_final = reference_hidden_states(model, ids, layer_ids)
        if aux.shape != ref_aux.shape or final.shape != ref_final.shape or \
                (aux - ref_aux).abs().max() > 1e-4 or (final - ref_final).abs().max() > 1e-4:
            bad += 1
    return bad


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--model-path", type=Path, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=64)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    model_path = args.model_path or build_tiny_model(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    facts = read_model_facts(model_path)
    layer_ids = default_aux_layer_ids(facts.num_layers)
    samples = make_samples(tokenizer, args.samples)
    tokens = sum(len(s.input_ids) for s in samples)
    model = load_reference_model(str(model_path))
    print(f"{len(samples)} samples, {tokens} tokens, model {facts.name} ({facts.num_layers} layers, "
          f"hidden {facts.hidden_size}), chunked prefill {args.chunked_prefill_size}, torch threads "
          f"{torch.get_num_threads()}")

    rows = [("naive (1 at a time, newest dump)", run_naive, 1)] + \
           [(f"content-matched, {k} in flight", run_core, k) for k in args.in_flight]
    table = []
    for label, fn, k in rows:
        dump_dir = work / f"dumps-{len(table)}"
        config = ServerConfig(model_path=model_path, dump_dir=dump_dir, rid_prefix=RID_PREFIX,
                              chunked_prefill_size=args.chunked_prefill_size)
        server = start_server(config, work / f"server-{len(table)}.log")
        try:
            f0, t0 = forward_time(server.url), time.perf_counter()
            results = fn(server, samples, layer_ids, facts.hidden_size, k)
            wall, fwd = time.perf_counter() - t0, forward_time(server.url) - f0
        finally:
            server.stop()
        table.append((label, len(samples) / wall, tokens / wall, fwd / wall, (wall - fwd) / len(samples) * 1e3,
                      count_mismatches(results, samples, model, layer_ids)))

    head = ("mode", "samples/s", "tokens/s", "pipeline eff.", "overhead ms/sample", "mismatched")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] * len(head)) + "|")
    for label, sps, tps, eff, ovh, bad in table:
        print(f"| {label} | {sps:.1f} | {tps:.0f} | {eff:.0%} | {ovh:.2f} | {bad} |")


if __name__ == "__main__":
    main()
