"""The dump patch at real load on a GPU node: throughput side by side, and every sample checked.

    python -m bench.sglang_load build-model DIR [--hidden 4096 ...]     random Llama of 8B width, bf16, on the GPU
    python -m bench.sglang_load prefill  --label L --model-path DIR ...  any server: prompt tokens/s, no dumps read
    python -m bench.sglang_load consume  --label L --dump-dir DIR ...    patched: each dump read, verified, deleted
    python -m bench.sglang_load extract  --label L --dump-dir DIR --shards DIR ...
                                                                        patched: the extraction core writes shards;
                                                                        then every sample against transformers
    python -m bench.sglang_load report RESULTS.jsonl                    the table

``bench/sglang_load.sh`` runs them on the lent H200 (unpatched SGLang, then two starts of the
patched one). Each phase sends its own random-token prompts (uniform lengths, a fresh rid and
``extra_key`` each, ``max_new_tokens`` 1) with ``--in-flight`` at once, on an emptied radix
cache, and appends one JSON line to ``--results``. Throughput is prompt tokens over the wall time from the first request
to the last answer (``prefill``) or to the last dump consumed (``consume``) or shard written
(``extract``). Over the same wall time, the CPU cores in use: the whole node, SGLang's
scheduler process (its main thread, which launches the forwards, and its other threads,
the dump writers among them) and this client (its reader processes included).
Each phase also keeps when every request was at the server (``timeline``): the requests the
server held, second by second, and the longest dump waits, which tell a phase slowed by the
server from one whose client sent too little.

The check compares each accepted sample with a transformers forward of its ids on the GPU,
in bf16 (every sample) and in fp32 (every ``--fp32-every``-th): per tap the max abs error,
beside the max abs distance from that tap to its neighbouring layers. A sample is wrong when a
tap's error to either reference exceeds a quarter of that distance (a wrong tap is ~as far as
a neighbour; bf16 noise is a tenth of it). Every failed attempt is counted by its error class,
also those a retry made good.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import requests
import torch

from patches.dumps import RID_PREFIX, DumpReader, default_aux_layer_ids
from tasks.dataset_version import ModelFacts, read_model_facts
from tasks.readers import ReaderPool
from tasks.retrieval import (ExpectedDump, InFlightLimit, RetrievalSettings, StageTimes, extract_batch,
                             extract_with_retries, into_shard, send_generate, threads_for)
from tasks.samples import PreparedSample


class AttemptErrors(logging.Handler):
    """Counts the extraction core's failed attempts by error class."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.examples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        name = getattr(record, "sample_error", None)
        if name:
            self.counts[name] += 1
            if len(self.examples) < 5:
                self.examples.append(record.getMessage()[:400])


class Timeline(StageTimes):
    """Stage times that also keep when each stage ran, to see where a phase's wall time goes: how many
    requests the server held second by second, and whether the end waits on a few stragglers."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[str, float, float]] = []  # (stage, start, end), time.monotonic()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            with super().stage(name):
                yield
        finally:
            with self._lock:
                self.spans.append((name, start, time.monotonic()))

    def summary(self, t0: float, wall_s: float) -> dict:
        """Per second of the phase: requests at the server and samples waiting for their dump (means), and answers;
        the last answer's time; the five longest dump waits and server stages (seconds, and when they ended)."""
        spans = [(name, a - t0, b - t0) for name, a, b in self.spans]
        seconds = int(wall_s) + 1

        def mean_held(stage: str) -> list[float]:
            held = [0.0] * seconds
            for name, a, b in spans:
                if name != stage:
                    continue
                for k in range(max(0, int(a)), min(seconds, int(b) + 1)):
                    held[k] += max(0.0, min(b, k + 1) - max(a, k))
            return [round(x / (min(k + 1, wall_s) - k), 1) for k, x in enumerate(held)]  # the last second is partial
        answers = [0] * seconds
        for name, _, b in spans:
            if name == "server":
                answers[min(seconds - 1, max(0, int(b)))] += 1

        def longest(stage: str) -> list[tuple[float, float]]:
            return sorted(((round(b - a, 3), round(b, 2)) for name, a, b in spans if name == stage), reverse=True)[:5]
        return {"at_server": mean_held("server"), "dump_wait": mean_held("dump wait"), "answers": answers,
                "last_answer_s": round(max((b for name, _, b in spans if name == "server"), default=0.0), 2),
                "longest_dump_waits": longest("dump wait"), "longest_server": longest("server")}


def make_prompts(n: int, seed: int, vocab: int, min_tokens: int, max_tokens: int) -> list[PreparedSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        ids = [rng.randrange(16, vocab) for _ in range(rng.randint(min_tokens, max_tokens))]
        samples.append(PreparedSample(sample_key=f"{seed:04d}{i:06d}{uuid.uuid4().hex[:6]}", source_id=f"s{seed}-{i}",
                                      line=i + 1, input_ids=ids, loss_mask=[1] * len(ids), truncated=False))
    return samples


def settings_for(args, facts: ModelFacts) -> RetrievalSettings:
    expected = ExpectedDump(tuple(default_aux_layer_ids(facts.num_layers)), facts.hidden_size, args.dtype)
    return RetrievalSettings(url=args.url, rid_prefix=RID_PREFIX, expected=expected, backoff_s=0.1,
                             dump_wait_s=120.0)


def flush_cache(url: str) -> None:
    """Empty the server's radix cache, so that no phase evicts what an earlier one left (a fresh
    server's first phase never evicts: the KV cache holds ~1.2M tokens of this model, a phase ~1.07M)."""
    r = requests.post(f"{url}/flush_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"POST {url}/flush_cache: {r.status_code} {r.text[:200]}")


def server_info(url: str) -> dict:
    info = requests.get(f"{url}/server_info", timeout=10).json()
    return {"version": info.get("version"), "chunked_prefill_size": info.get("chunked_prefill_size"),
            "disable_radix_cache": info.get("disable_radix_cache"), "dump_writer": info.get("dump_writer")}


def _stat_fields(stat_line: str) -> list[str]:
    """The fields of a /proc .../stat line after the process name (which may hold spaces): state, ppid, ..."""
    return stat_line.rsplit(")", 1)[1].split()


def _ticks(stat_line: str) -> int:
    """utime + stime of a /proc .../stat line (its fields 14 and 15)."""
    fields = _stat_fields(stat_line)
    return int(fields[11]) + int(fields[12])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process or thread ended meanwhile
        return None


def cpu_snapshot() -> dict[str, int]:
    """Cumulative CPU clock ticks of the node and of the processes a phase is about (see the module docstring)."""
    with open("/proc/stat") as f:
        node = [int(x) for x in f.readline().split()[1:]]
    snap = {"node": node[0] + node[1] + node[2] + sum(node[5:8]),  # user nice system irq softirq steal
            "scheduler_main": 0, "scheduler_other": 0, "client": _ticks(_read("/proc/self/stat"))}
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        cmdline, stat = _read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/stat")
        if cmdline is None or stat is None:
            continue
        if cmdline.startswith("sglang::scheduler"):
            # the process's own line counts the time of threads that have ended too
            main = _ticks(_read(f"/proc/{pid}/task/{pid}/stat") or stat)
            snap["scheduler_main"] += main
            snap["scheduler_other"] += _ticks(stat) - main
        elif _stat_fields(stat)[1] == me:  # a child of this client: a reader process
            snap["client"] += _ticks(stat)
    return snap


def cpu_cores(before: dict[str, int], wall_s: float) -> dict[str, float]:
    """Cores in use on average since ``before`` (a :func:`cpu_snapshot`), over ``wall_s``."""
    after, tick = cpu_snapshot(), os.sysconf("SC_CLK_TCK")
    return {k: round((after[k] - before[k]) / tick / wall_s, 2) for k in before}


def run_prefill(args, facts, samples) -> dict:
    settings = settings_for(args, facts)
    cached, times = [], Timeline()

    def send(sample: PreparedSample):
        with requests.Session() as session, times.stage("server"):
            meta = send_generate(settings, sample, f"{args.rid_prefix}{uuid.uuid4().hex}", session)
        cached.append(int(meta.get("cached_tokens", 0)))

    t0, cpu = time.monotonic(), cpu_snapshot()
    with ThreadPoolExecutor(args.in_flight) as pool:
        list(pool.map(send, samples))
    wall = time.monotonic() - t0
    return {"wall_s": wall, "cores": cpu_cores(cpu, wall), "written": len(samples), "cached_tokens": sum(cached),
            "timeline": times.summary(t0, wall)}


def reader_pool(args):
    """``--reader-processes`` processes, started (and their imports done) before the clock runs;
    0: the request threads read."""
    if not args.reader_processes:
        return nullcontext()
    readers = ReaderPool(args.reader_processes)
    readers.warm_up()
    return readers


def run_consume(args, facts, samples) -> dict:
    settings, reader = settings_for(args, facts), DumpReader(args.dump_dir)
    limit = InFlightLimit(args.in_flight, args.max_dump_bytes_in_flight)
    session = requests.Session()
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=args.in_flight))

    times = Timeline()

    with reader_pool(args) as readers:
        read = into_shard(settings.expected, reader, None, readers)

        def consume(sample: PreparedSample) -> bool:
            return extract_with_retries(settings, reader, sample, session, limit, read, times=times) is None

        t0, cpu = time.monotonic(), cpu_snapshot()
        with session, ThreadPoolExecutor(threads_for(limit)) as pool:
            ok = list(pool.map(consume, samples))
        wall = time.monotonic() - t0
        cores = cpu_cores(cpu, wall)
    return {"wall_s": wall, "cores": cores, "written": sum(ok), "failed": len(ok) - sum(ok), "stage_s": times.seconds,
            "timeline": times.summary(t0, wall)}


def run_extract(args, facts, samples) -> dict:
    settings, reader = settings_for(args, facts), DumpReader(args.dump_dir)
    limit = InFlightLimit(args.in_flight, args.max_dump_bytes_in_flight)
    args.shards.mkdir(parents=True, exist_ok=True)
    batches = [samples[i:i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    times = Timeline()

    with reader_pool(args) as readers:
        def batch(index: int) -> tuple[int, int, Path | None]:
            path = args.shards / f"{args.label}-{index:04d}.safetensors"
            shard, failed = extract_batch(settings, reader, batches[index], limit, path, priority=index, times=times,
                                          readers=readers)
            return (shard.samples if shard else 0), len(failed), path if shard else None

        t0, cpu = time.monotonic(), cpu_snapshot()
        with ThreadPoolExecutor(args.concurrent_batches) as pool:
            results = list(pool.map(batch, range(len(batches))))
        wall = time.monotonic() - t0
        cores = cpu_cores(cpu, wall)
    shards = [p for _, _, p in results if p is not None]
    if args.check_every:
        check = check_shards(args, shards)
    else:  # a timing-only phase: the shards are only in the way of the next one
        check = {}
        for path in shards:
            path.unlink()
    return {"wall_s": wall, "cores": cores, "written": sum(w for w, _, _ in results),
            "failed": sum(f for _, f, _ in results), "shards_dir": str(args.shards), "stage_s": times.seconds,
            "timeline": times.summary(t0, wall), **check}


def shard_samples(path: Path, every: int, hidden: int, device: str):
    """((first row, end row), input ids, [taps..., final, pre-norm] in fp32) of every ``every``-th sample of a
    shard. Read on the CPU and moved to ``device`` one sample at a time: a whole shard (~1.5 GB) beside the
    server and both reference models does not fit an 80 GB card (run K, H100)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        offsets = f.get_tensor("offsets").tolist()
        for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            if n % every:
                continue
            ids, aux, final, prenorm = (f.get_slice(name)[a:b].to(device) for name in (
                "input_ids", "aux_hidden_states", "final_hidden_states", "prenorm_hidden_states"))
            yield (a, b), ids.unsqueeze(0), [t.float() for t in aux.split(hidden, dim=-1)] + [final.float(),
                                                                                              prenorm.float()]


@torch.no_grad()
def check_shards(args, shards: list[Path]) -> dict:
    """Every sample of the shards against transformers on the GPU; each shard deleted once checked."""
    from transformers import AutoModelForCausalLM

    layer_ids = default_aux_layer_ids(read_model_facts(args.model_path).num_layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16).to(device).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).to(device).eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the pre-norm final state is the input of the model's final norm: caught by a hook in the same forward
    norm_input: dict[str, torch.Tensor] = {}
    for name, model in (("bf16", bf16), ("fp32", fp32)):
        model.model.norm.register_forward_pre_hook(lambda module, args, name=name: norm_input.__setitem__(name,
                                                                                                         args[0][0]))
    worst = {"bf16": [0.0] * 5, "fp32": [0.0] * 5}
    min_gap, checked, fp32_checked, wrong, examples = [float("inf")] * 3, 0, 0, 0, []
    hidden = read_model_facts(args.model_path).hidden_size
    t0 = time.monotonic()
    try:
        for path in shards:
            for (a, b), ids, got in shard_samples(path, args.check_every, hidden, device):
                refs = {"bf16": bf16(ids, output_hidden_states=True).hidden_states}
                if checked % args.fp32_every == 0:
                    refs["fp32"] = fp32(ids, output_hidden_states=True).hidden_states
                    fp32_checked += 1
                hs = [x[0].float() for x in refs["bf16"]]
                gaps = [min(float((hs[i] - hs[j]).abs().max()) for j in (i - 1, i + 1)) for i in layer_ids]
                min_gap = [min(x, y) for x, y in zip(min_gap, gaps)]
                bad = False
                for name, ref in refs.items():
                    want = [ref[i][0].float() for i in layer_ids] + [ref[-1][0].float(), norm_input[name].float()]
                    errs = [float((g - w).abs().max()) for g, w in zip(got, want)]
                    worst[name] = [max(x, y) for x, y in zip(worst[name], errs)]
                    # a tap is wrong when it is nearer another layer than its own; a final state (no
                    # neighbour to confuse it with) when its error is an eighth of its own largest value
                    # (bf16 rounding is ~1%; another request's state is off by its whole size)
                    limits = [g / 4 for g in gaps] + [float(w.abs().max()) / 8 for w in want[-2:]]
                    bad |= any(e > limit for e, limit in zip(errs, limits))
                    if bad and len(examples) < 5:
                        examples.append({"shard": path.name, "rows": [a, b], "ref": name, "errors": errs,
                                         "gaps": gaps})
                wrong += bad
                checked += 1
            path.unlink()
    finally:  # a check that stops early must not leave ~35 GB of shards in the next phase's memory (run K)
        for path in shards:
            path.unlink(missing_ok=True)
    return {"checked": checked, "fp32_checked": fp32_checked, "wrong": wrong, "check_s": time.monotonic() - t0,
            "max_err_bf16_ref": worst["bf16"], "max_err_fp32_ref": worst["fp32"], "min_neighbour_gap": min_gap,
            "wrong_examples": examples}


def report(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    unpatched = [r["tokens_per_s"] for r in rows if r["label"] == "unpatched" and r["phase"] == "prefill"]
    base = sum(unpatched) / len(unpatched) if unpatched else None
    lines = ["| run | phase | in flight | reader processes | samples | written | tokens | tokens/s | vs unpatched | "
             "s a sample: server / dump wait / reader wait / read+verify / shard write | failed attempts (by class) | "
             "checked (fp32) | wrong | cores: node / scheduler main / scheduler other / client |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.0%}" if base else "-"
        attempts = ", ".join(f"{k} {v}" for k, v in r.get("failed_attempts", {}).items()) or "0"
        check = f"{r['checked']} ({r['fp32_checked']})" if "checked" in r else "-"
        cores = " / ".join(f"{r['cores'][k]:.1f}" for k in CORE_GROUPS) if "cores" in r else "-"
        stages = " / ".join(f"{v / max(r['written'], 1):.3f}" for v in r["stage_s"].values()) if "stage_s" in r else "-"
        lines.append(f"| {r['label']} | {r['phase']} | {r.get('in_flight', '-')} | {r.get('reader_processes', 0)} | {r['samples']} | {r['written']} | "
                     f"{r['tokens']:,} | {r['tokens_per_s']:,.0f} | {rel} | {stages} | {attempts} | {check} | "
                     f"{r.get('wrong', '-')} | {cores} |")
    timed = [r for r in rows if "timeline" in r]
    if timed:
        lines += ["", "Requests at the server, mean of each second (the last answer at; the longest dump waits, s @ s):", ""]
        for r in timed:
            t = r["timeline"]
            waits = ", ".join(f"{w} @ {at}" for w, at in t["longest_dump_waits"][:3]) or "-"
            lines.append(f"- {r['label']} {r['phase']} ({r['wall_s']:.2f} s): {' '.join(map(str, t['at_server']))}; "
                         f"last answer {t['last_answer_s']} s; dump waits {waits}")
    return "\n".join(lines)


CORE_GROUPS = ("node", "scheduler_main", "scheduler_other", "client")
PHASES = {"prefill": run_prefill, "consume": run_consume, "extract": run_extract}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-model")
    build.add_argument("out_dir", type=Path)
    build.add_argument("--hidden", type=int, default=4096)
    build.add_argument("--intermediate", type=int, default=14336)
    build.add_argument("--layers", type=int, default=16)
    build.add_argument("--heads", type=int, default=32)
    build.add_argument("--kv-heads", type=int, default=8)
    build.add_argument("--device", default="cuda")
    rep = sub.add_parser("report")
    rep.add_argument("results", type=Path)
    for name in PHASES:
        p = sub.add_parser(name)
        p.add_argument("--label", required=True)
        p.add_argument("--url", default="http://127.0.0.1:30000")
        p.add_argument("--model-path", type=Path, required=True)
        p.add_argument("--dump-dir", type=Path)
        p.add_argument("--shards", type=Path)
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--samples", type=int, default=1000)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--min-tokens", type=int, default=128)
        p.add_argument("--max-tokens", type=int, default=2048)
        p.add_argument("--in-flight", type=int, default=64)
        p.add_argument("--max-dump-bytes-in-flight", type=int, default=3 << 30)
        p.add_argument("--batch-size", type=int, default=100)
        p.add_argument("--concurrent-batches", type=int, default=4)
        p.add_argument("--reader-processes", type=int, default=8, help="0: the request threads read the dumps")
        p.add_argument("--fp32-every", type=int, default=4, help="of the checked samples")
        p.add_argument("--check-every", type=int, default=1,
                       help="check every n-th sample of each shard (0: none, the shards are deleted unchecked)")
        p.add_argument("--rid-prefix", default=RID_PREFIX,
                       help="prefill: the rids' prefix (another than the server's dump prefix: hooks on, nothing dumped)")
        p.add_argument("--results", type=Path, required=True)
    args = ap.parse_args(argv)

    if args.command == "build-model":
        from infra.tiny_model import build_tiny_model
        build_tiny_model(args.out_dir, layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                         heads=args.heads, kv_heads=args.kv_heads, device=args.device, dtype=torch.bfloat16)
        return 0
    if args.command == "report":
        print(report(args.results))
        return 0

    facts = read_model_facts(args.model_path)
    samples = make_prompts(args.samples, args.seed, facts.vocab_size, args.min_tokens, args.max_tokens)
    errors = AttemptErrors()
    logging.getLogger("tasks.retrieval").addHandler(errors)
    logging.getLogger("tasks.retrieval").propagate = False  # counted, not printed per attempt
    flush_cache(args.url)
    result = PHASES[args.command](args, facts, samples)
    tokens = sum(len(s.input_ids) for s in samples)
    row = {"label": args.label, "phase": args.command, "samples": len(samples), "tokens": tokens,
           "tokens_per_s": tokens / result["wall_s"], **result, "failed_attempts": dict(errors.counts),
           "failed_attempt_examples": errors.examples, "in_flight": args.in_flight,
           "reader_processes": args.reader_processes, "server": server_info(args.url)}
    with args.results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "failed_attempt_examples"}))
    ok = result["written"] == len(samples) and not errors.counts and not result.get("wrong")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
