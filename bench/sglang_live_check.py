"""Check the dump patch inside a live SGLang server against a direct transformers forward.

    python -m bench.sglang_live_check --url http://127.0.0.1:30000 --model-path DIR --dump-dir DIR \
        [--samples 64] [--in-flight 8] [--report FILE]

For a GPU node (the CPU machines cannot run SGLang). The server must have been started
through ``patches.launch`` on the same model and dump folder. It runs three cases and
prints a table:

* ``concurrent chunked``: samples of 20-700 tokens through the extraction core
  (fresh rid and extra_key each, ``--in-flight`` at once) while other clients run
  health checks and long decodes, so prefill chunks, mixed steps and decode steps share
  batches. Each dump is compared tap by tap with HF ``hidden_states`` on CPU in float32.
  The error to the expected tap is set beside the distance to its neighbouring layers:
  a dump of the wrong layer or the wrong rows cannot pass as noise.
* ``prefix-cache repeat``: a prompt sent twice under one ``extra_key`` of its own; the
  second must be reported incomplete (the cache serves its head), never accepted.
* ``leftovers``: after the cases, the dump folder must hold no file of ours.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from pathlib import Path

import requests
import torch
from transformers import AutoTokenizer

from bench.benchmark import RID_PREFIX, make_samples
from patches.dumps import DumpIncomplete, DumpReader, default_aux_layer_ids
from tasks.dataset_version import read_model_facts
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, extract_samples, keep_samples
from tests.ground_truth import all_hidden_states, final_norm_input, load_reference_model


def wait_healthy(url: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(1)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s:.0f}s")


def background_traffic(url: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    """A load balancer's health checks and a client decoding long answers (rids without our prefix)."""
    def health():
        while not stop.wait(0.05):
            r = requests.get(f"{url}/health_generate", timeout=60)
            counts["health"] = counts.get("health", 0) + (r.status_code == 200)

    def decode():
        while not stop.is_set():
            r = requests.post(f"{url}/generate", timeout=120, json={
                "text": "Tell me a long story about hidden states.",
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}})
            counts["decode"] = counts.get("decode", 0) + (r.status_code == 200)

    threads = [threading.Thread(target=f, daemon=True) for f in (health, decode, decode)]
    for t in threads:
        t.start()
    return threads


def compare(dump_aux: torch.Tensor, dump_final: torch.Tensor, dump_prenorm: torch.Tensor, hs: list[torch.Tensor],
            prenorm: torch.Tensor, layer_ids) -> dict:
    """Max abs error per tap, the final state and the pre-norm final state (``prenorm``: the input of the
    reference's final norm), and the smallest max abs distance from the expected tap to another layer."""
    h = dump_final.shape[1]
    taps = dump_aux.float().split(h, dim=-1)
    errors = [float((t - hs[i]).abs().max()) for t, i in zip(taps, layer_ids)]
    errors.append(float((dump_final.float() - hs[-1]).abs().max()))
    errors.append(float((dump_prenorm.float() - prenorm).abs().max()))
    gaps = [min(float((hs[i] - hs[j]).abs().max()) for j in (i - 1, i + 1) if 0 <= j < len(hs) - 1)
            for i in layer_ids]
    return {"errors": errors, "gaps": gaps}


def check_concurrent(args, tokenizer, model, layer_ids, facts) -> dict:
    samples = make_samples(tokenizer, args.samples, seed=1, max_words=350)
    settings = RetrievalSettings(url=args.url, rid_prefix=RID_PREFIX,
                                 expected=ExpectedDump(tuple(layer_ids), facts.hidden_size, args.dtype))
    stop, counts = threading.Event(), {}
    threads = background_traffic(args.url, stop, counts)
    t0 = time.monotonic()
    written = []  # list.append is thread-safe; a check of this size fits in memory
    reader = DumpReader(args.dump_dir)
    failed = extract_samples(settings, reader, samples, InFlightLimit(args.in_flight, 2 << 30),
                             keep_samples(settings.expected, reader, written.append))
    wall = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(120)
    worst_err = [0.0] * (len(layer_ids) + 2)
    min_gap = [float("inf")] * len(layer_ids)
    for s in written:
        ids = s.input_ids.tolist()
        c = compare(s.aux_hidden_states, s.final_hidden_states, s.prenorm_hidden_states, all_hidden_states(model, ids),
                    final_norm_input(model, ids), layer_ids)
        worst_err = [max(a, b) for a, b in zip(worst_err, c["errors"])]
        min_gap = [min(a, b) for a, b in zip(min_gap, c["gaps"])]
    tokens = sum(len(s.input_ids) for s in samples)
    ok = not failed and len(written) == len(samples) and all(e < g / 10 for e, g in zip(worst_err, min_gap))
    return {"case": "concurrent chunked", "ok": ok, "samples": len(samples), "written": len(written),
            "failed": [f.__dict__ for f in failed][:5], "tokens": tokens, "wall_s": round(wall, 2),
            "max_err_per_tap_final_prenorm": worst_err, "min_neighbour_gap_per_tap": min_gap, "background": counts}


def check_prefix_repeat(args, tokenizer) -> dict:
    ids = make_samples(tokenizer, 1, seed=2, max_words=350)[0].input_ids
    reader = DumpReader(args.dump_dir)
    namespace = uuid.uuid4().hex  # one extra_key for both: only the first send can fill this cache
    outcomes = []
    for _ in range(2):
        rid = f"{RID_PREFIX}repeat-{uuid.uuid4().hex[:8]}"
        r = requests.post(f"{args.url}/generate", timeout=120, json={
            "input_ids": ids, "rid": rid, "extra_key": namespace, "sampling_params": {"max_new_tokens": 1}})
        cached = r.json()["meta_info"].get("cached_tokens")
        try:
            reader.assemble(rid, ids, reader.wait(rid, len(ids), timeout=30))
            outcomes.append({"cached_tokens": cached, "dump": "whole"})
        except DumpIncomplete as exc:
            outcomes.append({"cached_tokens": cached, "dump": f"incomplete: {exc}"[:200]})
        finally:
            reader.delete(rid)
    ok = outcomes[0]["dump"] == "whole" and outcomes[1]["dump"].startswith("incomplete")
    return {"case": "prefix-cache repeat", "ok": ok, "tokens": len(ids), "outcomes": outcomes}


def check_leftovers(args) -> dict:
    ours = [p.name for p in Path(args.dump_dir).iterdir() if p.name.startswith(RID_PREFIX)]
    return {"case": "leftovers", "ok": not ours, "files": ours[:10]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model-path", type=Path, required=True)
    ap.add_argument("--dump-dir", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", help="the dtype the server runs (the dumps carry it)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--health-timeout-s", type=float, default=300)
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)

    ready_s = wait_healthy(args.url, args.health_timeout_s)
    facts = read_model_facts(args.model_path)
    layer_ids = default_aux_layer_ids(facts.num_layers)
    model = load_reference_model(str(args.model_path))
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    info = requests.get(f"{args.url}/server_info", timeout=10).json()
    results = [check_concurrent(args, tokenizer, model, layer_ids, facts), check_prefix_repeat(args, tokenizer),
               check_leftovers(args)]
    report = {"sglang": info.get("version"), "dtype": args.dtype, "layer_ids": layer_ids, "ready_s": round(ready_s),
              "results": results}
    print(f"SGLang {report['sglang']}, dtype {args.dtype}, taps {layer_ids}, healthy after {ready_s:.0f}s")
    print("| case | ok | detail |")
    print("|---|---|---|")
    for r in results:
        detail = {k: v for k, v in r.items() if k not in ("case", "ok")}
        print(f"| {r['case']} | {'yes' if r['ok'] else 'NO'} | {json.dumps(detail)} |")
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
