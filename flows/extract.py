"""Prompts in, a verified EAGLE-3 training set out.

    python -m flows.extract                      # the demo: tiny local model, demo prompts, ./out
    python -m flows.extract --prompts FILE --out DIR --model-path DIR [--chunked-prefill-size N] ...

Start the server, prepare prompts, map batches, retry stragglers one by one, consolidate,
stop the server however the run ends.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote
from pydantic import BaseModel, Field, SecretStr
from tqdm import tqdm
from transformers import AutoTokenizer

from infra.server import ServerConfig, start_server
from infra.tiny_model import build_tiny_model
from patches.dumps import DumpReader
from tasks.dataset_version import extraction_config, read_model_facts, version_dir
from tasks.exports import check_exports
from tasks.chat_template import DEFAULT_ENABLE_THINKING, DEFAULT_TEMPLATE_DATE, TemplateVariables, template_hash
from tasks.prompts import write_rejects
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, SampleError, SampleFailure
from tasks.steps import consolidate_step, extract_batch_step, prepare_step, retry_sample_step
from tasks.shards import read_shard_index
from tasks.training_set import DatasetInfo
from tasks.vocab_mapping import draft_vocab_size_for

REPO = Path(__file__).resolve().parent.parent
DEMO_PROMPTS = REPO / "data" / "demo_prompts.jsonl"
RID_PREFIX = "eagle3-"
PROJECT_VERSION = "0.1.0"


class ServerOptions(BaseModel):
    """How the model server is run (flags under SGLang's names)."""

    chunked_prefill_size: int | None = Field(None, title="--chunked-prefill-size", ge=-1,
                                             description="Prefill tokens per forward; -1 disables chunking.")
    disable_radix_cache: bool = Field(False, title="--disable-radix-cache")
    skip_server_warmup: bool = Field(False, title="--skip-server-warmup")
    device: Literal["cpu", "cuda"] = Field("cpu", title="--device")
    port: int = Field(0, title="--port", ge=0, le=65535, description="0 picks a free port.")
    api_key: SecretStr | None = Field(None, title="--api-key")
    ready_timeout_s: float = Field(300.0, title="Seconds to wait for /health", gt=0)
    extra_args: list[str] = Field([], title="More server flags", description="Passed to the server as they are.")


class ExtractParameters(BaseModel):
    prompts: str = Field(str(DEMO_PROMPTS), title="Prompt file (JSONL, JSON or Parquet)")
    model_path: str | None = Field(None, title="Model folder",
                                   description="A local Hugging Face model folder; empty: the tiny demo model.")
    out: str = Field("out", title="Output folder")
    server: ServerOptions = Field(default_factory=ServerOptions)
    batch_size: int = Field(100, title="Samples per batch task", ge=1, le=5000)
    max_in_flight: int = Field(8, title="Requests in flight", ge=1, le=1024)
    max_dump_bytes_in_flight: int = Field(
        2 << 30, title="Dump bytes in flight", ge=1 << 20,
        description="Hidden-state bytes of requests sent but not yet read back, over all batches; below the "
                    "server writer's budget, so a slow reader slows the server instead of losing dumps.")
    concurrent_batches: int = Field(2, title="Batch tasks at once", ge=1, le=64)
    attempts: int = Field(3, title="Attempts per sample inside its batch", ge=1, le=20)
    sample_retries: int = Field(2, title="Prefect retries of a sample its batch could not extract", ge=0, le=20)
    backoff_s: float = Field(0.5, title="Seconds before the first retry", ge=0, le=600,
                             description="Doubles with each retry, inside a batch and in a sample's own task.")
    max_length: int = Field(2048, title="Max tokens per sample", ge=2)
    on_overlong: Literal["truncate", "skip"] = Field("truncate", title="Overlong samples")
    aux_layers: list[int] | None = Field(None, title="Aux layers (HF hidden_states indices)",
                                         description="Empty: the EAGLE-3 default [2, N//2, N-3].")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", title="--dtype")
    exports: list[Literal["specforge", "speculators", "modelopt"]] = Field(
        [], title="Trainer exports", description="Written next to the shards, a second copy of the data; "
                                                 "`python -m tasks.exports` writes them on demand instead.")
    store_dtype: Literal["float8_e4m3fn"] | None = Field(
        None, title="--store-dtype", description="Empty: store the hidden states in --dtype; float8_e4m3fn: "
                                                 "half of bf16's bytes, per-token scales (see README).")
    draft_vocab_size: int | None = Field(None, title="--draft-vocab-size", ge=1,
                                         description="Draft vocabulary of the d2t/t2d mapping; empty: 32000, "
                                                     "or the target's vocabulary when smaller.")
    template_date: str = Field(DEFAULT_TEMPLATE_DATE, title="Date the chat template writes (YYYY-MM-DD)",
                               pattern=r"^\d{4}-\d{2}-\d{2}$",
                               description="What templates that write today's date (Llama 3.x, gpt-oss) see, "
                                           "fixed so every night gives the same ids. Part of the version.")
    enable_thinking: bool = Field(DEFAULT_ENABLE_THINKING, title="enable_thinking (chat template variable)",
                                  description="Qwen3 and others; part of the version.")
    chat_template_kwargs: dict[str, Any] = Field({}, title="More chat template variables (JSON values)",
                                                 description="Passed to the template; part of the version.")

    def template_variables(self) -> TemplateVariables:
        return TemplateVariables(self.template_date, self.enable_thinking, self.chat_template_kwargs)


def resolve_model(params: ExtractParameters) -> Path:
    if params.model_path:
        path = Path(params.model_path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        return path
    return build_tiny_model(Path(params.out).resolve() / "models" / "tiny")


# Bounded: the default thread pool is unbounded (prefect.md); it runs the per-sample retry tasks.
@flow(name="extract-eagle3", task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=False)
def extract(params: ExtractParameters = ExtractParameters()) -> dict:
    log = get_run_logger()
    started = time.monotonic()
    out = Path(params.out).resolve()
    model_path = resolve_model(params)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    facts = read_model_facts(model_path)
    variables = params.template_variables()
    config = extraction_config(facts, params.aux_layers, params.dtype, template_hash(tokenizer),
                               params.max_length, params.on_overlong, params.store_dtype,
                               template_variables=variables.record())
    vdir = version_dir(out, config)
    (vdir / "shards").mkdir(parents=True, exist_ok=True)
    log.info("dataset version %s in %s", config.fingerprint(), vdir)

    info = DatasetInfo(model=facts.name, layer_ids=list(config.layer_ids), layer_convention=config.layer_convention,
                       final_states=config.final_states, dtype=config.dtype, store_dtype=config.store_dtype,
                       hidden_size=facts.hidden_size,
                       num_layers=facts.num_layers, vocab_size=facts.vocab_size, template_hash=config.template_hash,
                       max_length=config.max_length, project_version=PROJECT_VERSION,
                       fingerprint=config.fingerprint(), template_variables=config.template_variables)
    # An export that cannot be made from this data must fail now, not after hours of extraction.
    check_exports(params.exports, info)
    draft_vocab_size_for(info, params.draft_vocab_size)

    prepared = prepare_step(Path(params.prompts), tokenizer, params.max_length, params.on_overlong, variables)
    write_rejects(vdir / "rejects.jsonl", prepared.rejected)
    done = {row["sample_key"] for shard in sorted((vdir / "shards").glob("*.safetensors"))
            for row in read_shard_index(shard)}
    todo = [s for s in prepared.samples if s.sample_key not in done]
    log.info("%d rows: %d samples (%d already extracted), %d duplicates, %d rejected",
             prepared.rows_in, len(prepared.samples), len(prepared.samples) - len(todo),
             len(prepared.duplicates), len(prepared.rejected))

    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    failures: list[SampleFailure] = []
    new_tokens = 0
    extract_s = 0.0
    if todo:
        new_tokens, failures, extract_s = run_extraction(params, model_path, out, vdir, run_id, todo,
                                                         config.layer_ids, facts.hidden_size)
    else:
        log.info("nothing new to extract: all %d samples are in dataset version %s",
                 len(prepared.samples), config.fingerprint())

    failed_keys = {f.sample_key for f in failures}
    keep = {s.sample_key for s in prepared.samples if s.sample_key not in failed_keys}
    consolidated = consolidate_step(vdir, info, keep, list(params.exports), params.draft_vocab_size)

    summary = {
        "run": run_id, "version": config.fingerprint(), "version_dir": str(vdir),
        "rows_in": prepared.rows_in, "written": len(keep), "written_this_run": len(todo) - len(failures),
        "already_present": len(prepared.samples) - len(todo), "duplicates": len(prepared.duplicates),
        "rejected": len(prepared.rejected), "failed": len(failures), "tokens_this_run": new_tokens,
        "dataset_tokens": consolidated.tokens, "dataset_bytes": consolidated.bytes,
        "tokens_per_s": round(new_tokens / extract_s, 1) if extract_s else 0.0,
        "wall_s": round(time.monotonic() - started, 2),
    }
    accounted = summary["written"] + summary["duplicates"] + summary["rejected"] + summary["failed"]
    if accounted != prepared.rows_in:
        raise RuntimeError(f"sample accounting is off: {prepared.rows_in} rows in, {accounted} accounted for "
                           f"({summary})")
    record_run(vdir, run_id, summary, failures)
    create_table_artifact(key="extraction-summary", table=[summary],
                          description=f"Dataset version {config.fingerprint()} in {vdir}")
    if failures:
        create_table_artifact(key="failed-samples", description="Samples that failed every attempt",
                              table=[{"source_id": f.source_id, "sample_key": f.sample_key, "error": f.error,
                                      "reason": f.reason, "attempts": f.attempts} for f in failures])
    log.info("summary: %s", json.dumps(summary))
    return summary


def run_extraction(params: ExtractParameters, model_path: Path, out: Path, vdir: Path, run_id: str,
                   todo: list, layer_ids: tuple[int, ...], hidden_size: int) -> tuple[int, list[SampleFailure], float]:
    """Start the server, extract every batch, retry stragglers, stop the server whatever happens."""
    log = get_run_logger()
    dump_dir = out / "dumps"
    dump_dir.mkdir(parents=True, exist_ok=True)
    # Leftovers of killed runs: their rids carry other nonces and are never matched; clear them.
    stale = DumpReader(dump_dir).remove_stale(ttl_s=3600)
    if stale:
        log.info("removed %d stale dump files from %s", stale, dump_dir)
    opts = params.server
    api_key = opts.api_key.get_secret_value() if opts.api_key else None
    server_config = ServerConfig(model_path=model_path, dump_dir=dump_dir, rid_prefix=RID_PREFIX, port=opts.port,
                                 aux_layer_ids=layer_ids, dtype=params.dtype, device=opts.device,
                                 chunked_prefill_size=opts.chunked_prefill_size,
                                 disable_radix_cache=opts.disable_radix_cache,
                                 skip_server_warmup=opts.skip_server_warmup, api_key=api_key,
                                 extra_args=tuple(opts.extra_args))
    server = start_server(server_config, vdir / "runs" / f"{run_id}-server.log", ready_timeout_s=opts.ready_timeout_s)
    try:
        settings = RetrievalSettings(url=server.url, rid_prefix=RID_PREFIX,
                                     expected=ExpectedDump(tuple(layer_ids), hidden_size, params.dtype),
                                     headers=tuple(server.headers().items()), attempts=params.attempts,
                                     backoff_s=params.backoff_s)
        started = time.monotonic()
        batches = [todo[i:i + params.batch_size] for i in range(0, len(todo), params.batch_size)]
        limit = InFlightLimit(params.max_in_flight, params.max_dump_bytes_in_flight)
        runner = ThreadPoolTaskRunner(max_workers=params.concurrent_batches)
        with tqdm(total=len(todo), unit="sample", desc="extracting") as bar, runner:
            futures = [runner.submit(extract_batch_step, parameters=dict(
                index=i, samples=quote(batch), settings=settings, dump_dir=dump_dir,
                shard_path=vdir / "shards" / f"shard-{run_id}-{i:05d}.safetensors",
                limit=limit, on_done=bar.update, store_dtype=params.store_dtype))
                for i, batch in enumerate(batches)]
            wait(futures)
            results = [f.result() for f in futures]
        tokens = sum(r.shard.tokens for r in results if r.shard)
        stragglers = [f for r in results for f in r.failures]
        failures: list[SampleFailure] = []
        if stragglers:
            by_key = {s.sample_key: s for s in todo}
            retry = retry_sample_step.with_options(retries=params.sample_retries,
                                                   retry_delay_seconds=exponential_backoff(params.backoff_s))
            pending = [(f, retry.submit(quote(by_key[f.sample_key]), f, settings, dump_dir,
                                        vdir / "shards" / f"shard-{run_id}-retry-{n:05d}.safetensors",
                                        params.store_dtype))
                       for n, f in enumerate(stragglers)]
            wait([p for _, p in pending])
            for first, future in pending:
                if future.state.is_completed():
                    tokens += future.result().tokens
                elif not first.retryable:
                    failures.append(first)  # its node failed at once; nothing was sent again
                else:
                    exc = future.state.result(raise_on_failure=False)
                    if not isinstance(exc, SampleError):
                        raise exc  # not the sample's fault (a shard that cannot be written...): fail loudly
                    failures.append(SampleFailure(first.sample_key, first.source_id, exc.reason,
                                                  type(exc).__name__, exc.retryable, exc.attempt))
        return tokens, failures, time.monotonic() - started
    finally:
        code = server.stop()
        log.info("server stopped (exit code %s); log %s", code, server.log_path)


def record_run(vdir: Path, run_id: str, summary: dict, failures: list[SampleFailure]) -> None:
    runs = vdir / "runs"
    runs.mkdir(exist_ok=True)
    (runs / f"{run_id}.json").write_text(json.dumps({"summary": summary, "failed": [f.__dict__ for f in failures]},
                                                    indent=2))


def parse_args(argv: list[str] | None = None) -> ExtractParameters:
    p = argparse.ArgumentParser(prog="python -m flows.extract", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ExtractParameters()
    p.add_argument("--prompts", default=d.prompts)
    p.add_argument("--model-path", default=None)
    p.add_argument("--out", default=d.out)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight)
    p.add_argument("--max-dump-bytes-in-flight", type=int, default=d.max_dump_bytes_in_flight)
    p.add_argument("--concurrent-batches", type=int, default=d.concurrent_batches)
    p.add_argument("--attempts", type=int, default=d.attempts)
    p.add_argument("--sample-retries", type=int, default=d.sample_retries)
    p.add_argument("--backoff-s", type=float, default=d.backoff_s)
    p.add_argument("--max-length", type=int, default=d.max_length)
    p.add_argument("--on-overlong", choices=["truncate", "skip"], default=d.on_overlong)
    p.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="ID")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=d.dtype)
    p.add_argument("--exports", nargs="*", default=d.exports, choices=["specforge", "speculators", "modelopt"])
    p.add_argument("--store-dtype", choices=["float8_e4m3fn"], default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--template-date", default=d.template_date, metavar="YYYY-MM-DD")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=d.enable_thinking)
    p.add_argument("--chat-template-kwargs", type=json.loads, default={}, metavar="JSON")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    server = ServerOptions(chunked_prefill_size=a.chunked_prefill_size, disable_radix_cache=a.disable_radix_cache,
                           skip_server_warmup=a.skip_server_warmup, device=a.device, port=a.port)
    return ExtractParameters(prompts=a.prompts, model_path=a.model_path, out=a.out, server=server,
                             batch_size=a.batch_size, max_in_flight=a.max_in_flight,
                             max_dump_bytes_in_flight=a.max_dump_bytes_in_flight,
                             concurrent_batches=a.concurrent_batches, attempts=a.attempts,
                             sample_retries=a.sample_retries, backoff_s=a.backoff_s, max_length=a.max_length,
                             on_overlong=a.on_overlong,
                             aux_layers=a.aux_layers, dtype=a.dtype, exports=a.exports,
                             store_dtype=a.store_dtype, draft_vocab_size=a.draft_vocab_size,
                             template_date=a.template_date, enable_thinking=a.enable_thinking,
                             chat_template_kwargs=a.chat_template_kwargs)


if __name__ == "__main__":
    summary = extract(parse_args())
    print(json.dumps(summary, indent=2))
