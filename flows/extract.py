"""Prompts in, a verified EAGLE-3 training set out.

    python -m flows.extract                      # the demo: tiny local model, demo prompts, ./out
    python -m flows.extract --prompts FILE --out DIR --model-path DIR [--chunked-prefill-size N] ...
    python -m flows.extract ... --engine sglang --node ssh://USER@HOST[:PORT] --ssh-key KEY \\
        --known-hosts FILE [--node-python PY] [--node-workdir DIR] [--node-dump-dir DIR] [-- SGLang flags]

Start the server, prepare prompts, map batches, retry stragglers one by one, consolidate,
stop the server however the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Literal

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                              update_progress_artifact)
from prefect.blocks.system import Secret
from prefect.futures import as_completed, wait
from prefect.runtime import flow_run as current_flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote
from pydantic import BaseModel, Field, model_validator
from tqdm import tqdm
from transformers import AutoTokenizer

from flows.cli import ModelCli
from flows.terminal import FILE_ONLY, log_to_file
from infra.prefect_api import start_temporary_prefect_api
from infra.node_block import SshNodeBlock
from infra.node_slot import node_slot
from infra.server import RunningServer, ServerConfig, ServerWatch, check_server_args, listen_hosts, start_server
from infra.ssh import DumpMirror, NodeCommandFailed, SshError, SshHost, SshNode, SshSettings, parse_node_url
from infra.tiny_model import build_tiny_model
from patches.dumps import DumpReader
from patches.launch import API_KEY_ENV
from tasks.accounting import reconcile
from tasks.dataset_version import (ModelFacts, extraction_config, lock_holder, read_model_facts, version_dir,
                                  version_lock)
from tasks.exports import check_exports
from tasks.chat_template import DEFAULT_ENABLE_THINKING, DEFAULT_TEMPLATE_DATE, TemplateVariables, template_hash
from tasks.prompts import write_rejects
from tasks.report import run_report
from tasks.readers import ReaderPool, reader_process_count
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, SampleError, SampleFailure, StageTimes
from tasks.steps import (consolidate_step, extract_batch_step, node_batch_step, node_retry_sample_step, prepare_step,
                         retry_sample_step)
from tasks.shards import list_shards, read_shard_index, remove_unfinished_shards
from tasks.training_set import DatasetInfo, atomic_write, point_latest
from tasks.vocab_mapping import draft_vocab_size_for

REPO = Path(__file__).resolve().parent.parent
DEMO_PROMPTS = REPO / "data" / "demo_prompts.jsonl"
RID_PREFIX = "eagle3-"
PROJECT_VERSION = "0.1.0"


class ServerOptions(BaseModel):
    """How the model server is run (flags under SGLang's names)."""

    engine: Literal["transformers", "sglang"] = Field(
        "transformers", title="Server engine",
        description="transformers: the project's own server (a Hugging Face forward, CPU or GPU); "
                    "sglang: real SGLang with the dump patch (patches.launch), on a GPU node.")
    chunked_prefill_size: int | None = Field(None, title="Chunked prefill size", ge=-1,
                                             description="Prefill tokens per forward; -1 disables chunking; "
                                                         "empty: the server's default.")
    disable_radix_cache: bool = Field(False, title="Disable the radix cache",
                                      description="Every request is prefilled in full, no prefix reuse.")
    skip_server_warmup: bool = Field(False, title="Skip the server's warm-up",
                                     description="Start faster; the first requests pay for it.")
    device: Literal["cpu", "cuda"] | None = Field(None, title="Device",
                                                  description="Empty: cpu for the transformers engine, cuda for "
                                                              "sglang.")
    port: int = Field(0, title="Server port", ge=0, le=65535,
                      description="Loopback port of the server; 0 picks a free one.")
    api_key_block: str | None = Field(None, title="API key: Prefect Secret block",
                                      description="Name of a saved Prefect Secret block holding the key the server "
                                                  "requires on every request (or a file, next; or the "
                                                  f"{API_KEY_ENV} environment variable; none: no key).")
    api_key_file: str | None = Field(None, title="API key: file",
                                     description="A file on the flow's machine holding the server's key (its path "
                                                 "is the parameter, never the key).")
    ready_timeout_s: float = Field(300.0, title="Start-up timeout (s)", gt=0, le=86400,
                                   description="How long to wait for the server's /health before giving up.")
    health_timeout_s: float = Field(30.0, title="Health-check timeout (s)", gt=0, le=3600,
                                    description="While batches run the server's /health is checked; unanswered "
                                                "within this twice in a row, the server is hung: it is killed and "
                                                "restarted (--server-restarts). Above SGLang's own 20 s.")
    extra_args: list[str] = Field([], title="More server flags",
                                  description="Passed to the server as they are (after -- on the command line); "
                                              "never --api-key (see above).")
    allow_non_loopback: bool = Field(False, title="Allow listening beyond loopback",
                                     description="Let the flags above make the server listen on other interfaces "
                                                 "(--host 0.0.0.0): anyone who reaches the host can then use it. "
                                                 "Refused without this; logged with it.")

    @model_validator(mode="after")
    def _safe_server_args(self) -> "ServerOptions":
        if self.api_key_block and self.api_key_file:
            raise ValueError("give the API key one way: --api-key-block or --api-key-file")
        check_server_args(self.extra_args, self.allow_non_loopback)
        return self

    @property
    def device_or_default(self) -> str:
        return self.device or ("cuda" if self.engine == "sglang" else "cpu")


class NodeOptions(BaseModel):
    """Where the server runs: this machine, or a GPU node over SSH (paths are the node's)."""

    node: str = Field("local", title="GPU node", description="local (this machine), or ssh://USER@HOST[:PORT].")
    block: str | None = Field(None, title="Saved node block",
                              description="A saved eagle3-ssh-node block; replaces node, key, known_hosts, "
                                          "python, workdir and dump folder below.")
    ssh_key: str | None = Field(None, title="SSH private key file",
                                description="A file on this machine (required for an ssh:// node without a block).")
    known_hosts: str = Field("~/.ssh/known_hosts", title="Known hosts file",
                             description="The node's host key must be in it; an unknown key is refused.")
    python: str = Field("python3", title="Python on the node",
                        description="Interpreter that runs the node agent and the server.")
    workdir: str = Field("eagle3-extract", title="Work folder on the node",
                         description="Code, servers and node-side shards; relative: under the node's home.")
    dump_dir: str | None = Field(None, title="Dump folder on the node",
                                 description="Where the server writes hidden states; empty: <workdir>/dumps.")
    shards_on: Literal["here", "node"] | None = Field(
        None, title="Where shards are written",
        description="node (the default for an SSH node: README says why): batches run and shards stay there; "
                    "here: requests through a tunnel, dumps read over the connection.")
    fetch: bool = Field(False, title="Fetch the shards",
                        description="Bring the node's shards home after the run and make the exports here.")
    lease_timeout_s: float = Field(60.0, title="Server lease (s)", ge=2, le=3600,
                                   description="A server whose lease the flow stops renewing stops after this.")

    @model_validator(mode="after")
    def _node_flags_need_a_node(self) -> "NodeOptions":
        if not self.remote and (self.shards_on or self.fetch):
            raise ValueError("--shards-on and --fetch apply to an SSH node (--node ssh://... or --node-block)")
        if self.fetch and self.shards_on == "here":
            raise ValueError("--fetch brings home shards written on the node; with --shards-on here they are here")
        return self

    @property
    def remote(self) -> bool:
        return self.node != "local" or self.block is not None

    @property
    def shards_remote(self) -> bool:
        return self.remote and self.shards_on != "here"

    def host_name(self) -> str:
        """The machine the server runs on, as its concurrency limit is named (infra/node_slot.py)."""
        return self.ssh_settings().host if self.remote else socket.gethostname()

    def ssh_settings(self) -> SshSettings:
        if self.block:
            return SshNodeBlock.load(self.block).settings()
        user, host, port = parse_node_url(self.node)
        return SshSettings(user=user, host=host, port=port, known_hosts=Path(self.known_hosts),
                           key_path=Path(self.ssh_key) if self.ssh_key else None, python=self.python,
                           workdir=self.workdir, dump_dir=self.dump_dir)


class ExtractParameters(BaseModel):
    """One extraction: which prompts through which model into which folder, and how."""

    prompts: str = Field(str(DEMO_PROMPTS), title="Prompts",
                         description="A JSONL, JSON or Parquet file, or a folder or glob of them (read in name "
                                     "order; a nightly run picks up files added since).")
    model_path: str | None = Field(None, title="Model folder",
                                   description="A local Hugging Face model folder (on the node with an SSH node); "
                                               "empty: the tiny demo model.")
    out: str = Field("out", title="Output folder",
                     description="Dataset versions, dumps and run records go under it.")
    server: ServerOptions = Field(default_factory=ServerOptions, title="Server")
    node: NodeOptions = Field(default_factory=NodeOptions, title="Node")
    batch_size: int = Field(100, title="Samples per batch task", ge=1, le=5000,
                            description="One task run and one shard per batch; keeps the flow-run graph small.")
    max_in_flight: int = Field(8, title="Requests in flight", ge=1, le=1024,
                               description="Requests sent to the server and not yet answered, over all batches.")
    max_dump_bytes_in_flight: int = Field(
        2 << 30, title="Dump bytes in flight", ge=1 << 20, le=1 << 40,
        description="Hidden-state bytes of requests sent but not yet read back, over all batches: a slow reader "
                    "slows the server instead of losing dumps. The server's dump writer gets twice this as its "
                    "budget. 64 requests of 2k tokens at hidden 4096 take ~5.4 GB.")
    reader_processes: int | None = Field(
        None, title="Dump reader processes", ge=0, le=256,
        description="Processes that read, verify and write the dumps into shards, on the machine that reads them "
                    "(the node with shards on the node); empty: half its cores; 0: the request threads do it. "
                    "One reads ~0.5-1 GB/s beside a busy server: an H200 at hidden 4096 makes ~3.3 GB/s of dumps. "
                    "Each keeps a buffer of the largest sample it has read.")
    concurrent_batches: int = Field(2, title="Batch tasks at once", ge=1, le=64,
                                    description="Batch tasks running at the same time.")
    version_wait_s: float = Field(0.0, title="Wait for another run on the version (s)", ge=0, le=86400,
                                  description="Another run writing the same dataset version folder: wait this long "
                                              "for it to finish, then refuse; 0: refuse at once.")
    attempts: int = Field(3, title="Attempts per sample inside its batch", ge=1, le=20,
                          description="A sample that fails this often goes to its own retry task.")
    sample_retries: int = Field(2, title="Retries of a straggler", ge=0, le=20,
                                description="Prefect retries of a sample its batch could not extract, in its "
                                            "own sample-<id> task.")
    backoff_s: float = Field(0.5, title="Seconds before the first retry", ge=0, le=600,
                             description="Doubles with each retry, inside a batch and in a sample's own task.")
    server_restarts: int = Field(2, title="Server restarts", ge=0, le=20,
                                 description="A server that dies mid-run is restarted this often (with its log "
                                             "tail in the run log); the samples it had not finished go on.")
    max_failed_fraction: float = Field(
        0.01, title="Failed samples allowed (fraction)", ge=0, le=1,
        description="Past it the run fails (a Failed flow run, exit code 1) instead of retrying each sample in "
                    "its own task; failed samples are recorded either way.")
    max_length: int = Field(2048, title="Max tokens per sample", ge=2, le=1 << 20,
                            description="Longer samples are truncated or skipped (next option).")
    on_overlong: Literal["truncate", "skip"] = Field("truncate", title="Overlong samples",
                                                     description="truncate to the max length, or skip them "
                                                                 "(listed in rejects.jsonl).")
    aux_layers: list[int] | None = Field(None, title="Aux layers", min_length=3, max_length=3,
                                         description="Three HF hidden_states indices; empty: the EAGLE-3 default "
                                                     "[2, N//2, N-3]. Part of the version.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", title="Model dtype",
                                                              description="The server's compute dtype and the "
                                                                          "stored hidden states' dtype.")
    exports: list[Literal["specforge", "speculators", "modelopt"]] = Field(
        [], title="Trainer exports", description="Written next to the shards, a second copy of the data; "
                                                 "`python -m tasks.exports` writes them on demand instead.")
    store_dtype: Literal["float8_e4m3fn"] | None = Field(
        None, title="Stored dtype", description="Empty: store the hidden states in the model dtype; "
                                                "float8_e4m3fn: half of bf16's bytes, per-token scales (README).")
    draft_vocab_size: int | None = Field(None, title="Draft vocabulary size", ge=1,
                                         description="Draft vocabulary of the d2t/t2d mapping; empty: 32000, "
                                                     "or the target's vocabulary when smaller.")
    template_date: str = Field(DEFAULT_TEMPLATE_DATE, title="Date the chat template writes (YYYY-MM-DD)",
                               pattern=r"^\d{4}-\d{2}-\d{2}$",
                               description="What templates that write today's date (Llama 3.x, gpt-oss) see, "
                                           "fixed so every night gives the same ids. Part of the version.")
    enable_thinking: bool = Field(DEFAULT_ENABLE_THINKING, title="Enable thinking (chat template variable)",
                                  description="Qwen3 and others; part of the version.")
    chat_template_kwargs: dict[str, Any] = Field({}, title="More chat template variables (JSON)",
                                                 description="Passed to the template; part of the version.")
    retry_failed_of: str | None = Field(
        None, title="Retry the failed samples of version", pattern=r"^[0-9a-f]{16}$",
        description="A dataset version (16 hex digits): extract only the samples its runs recorded as failed "
                    "and not written since, into it, nothing new; the other parameters must give that version.")

    def template_variables(self) -> TemplateVariables:
        return TemplateVariables(self.template_date, self.enable_thinking, self.chat_template_kwargs)


#: the files of a model folder the flow machine needs (config and tokenizer), fetched from a node
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


class ServerDied(RuntimeError):
    """The run's server exited, or hung and was killed, while batches were running."""

    def __init__(self, reason: str, tokens: int):
        self.tokens = tokens  # written before it died
        super().__init__(reason)


class RunFailed(RuntimeError):
    """The run could not produce what it was asked for (failure budget, a server that keeps dying).

    ``record``: the run record listing the failed samples, when there is one."""

    def __init__(self, reason: str, record: Path | None = None):
        self.record = record
        super().__init__(reason)


class CannotRetry(ValueError):
    """--retry-failed-of names a version these parameters do not give, or one with no readable run records."""


def failure_budget(params: ExtractParameters, samples: int) -> int:
    return int(params.max_failed_fraction * samples)


class NodeNotReady(SshError):
    """The node lacks what the chosen engine needs; the message names it and the command it would run."""


def resolve_model(params: ExtractParameters) -> tuple[str, ModelFacts, Path]:
    """(model path as the server sees it, its facts, a local folder with its config and tokenizer)."""
    if params.node.remote:
        if not params.model_path:
            raise ValueError("--model-path (a folder on the node) is required with --node ssh://...")
        with SshNode(params.node.ssh_settings()) as node:
            node.prepare()
            facts = ModelFacts(**node.agent(["model-facts", "--model-path", params.model_path]))
            local = Path(params.out).resolve() / "models" / "node" / facts.identity
            names = node.run(["ls", "-1", params.model_path]).stdout.decode().splitlines()
            for name in sorted(set(names) & set(TOKENIZER_FILES)):
                if not (local / name).exists():
                    node.read_file(f"{params.model_path}/{name}", local / name)
        return params.model_path, facts, local
    if params.model_path:
        path = Path(params.model_path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
    else:
        path = build_tiny_model(Path(params.out).resolve() / "models" / "tiny")
    return str(path), read_model_facts(path), path


def shard_index(params: ExtractParameters, vdir: Path, fingerprint: str) -> list[dict]:
    """Index rows of the version's finished shards, here or on the node (``--shards-on node``)."""
    if params.node.shards_remote:
        with SshNode(params.node.ssh_settings()) as node:
            node.prepare()
            return node.python_module("tasks.node_batch", ["index", "--version-dir", node.version_dir(fingerprint)])[
                "index"]
    return [row for shard in list_shards(vdir) for row in read_shard_index(shard)]


def finish_dataset(params: ExtractParameters, vdir: Path, info: DatasetInfo, keep: set[str]):
    """Manifest, dataset.json and exports. Shards on a node: their index comes back, and with
    ``--fetch`` the shards too (then the exports are made here)."""
    if not params.node.shards_remote:
        return consolidate_step(vdir, info, keep, list(params.exports), params.draft_vocab_size)
    rows = shard_index(params, vdir, info.fingerprint)
    if not params.node.fetch:
        get_run_logger().info("shards stay on %s; --fetch brings them home and makes the exports %s",
                              params.node.ssh_settings().url, params.exports)
        return consolidate_step(vdir, info, keep, [], params.draft_vocab_size, index_rows=rows)
    with SshNode(params.node.ssh_settings()) as node:
        node.prepare()
        remote = node.version_dir(info.fingerprint)
        for name in sorted({row["shard"] for row in rows if row["sample_key"] in keep}):
            if not (vdir / "shards" / name).exists():
                node.read_file(f"{remote}/shards/{name}", vdir / "shards" / name)
    return consolidate_step(vdir, info, keep, list(params.exports), params.draft_vocab_size)


# --------------------------------------------------------------------------- stopping node servers from hooks


def record_node_server(out: Path, node: NodeOptions, server_dir: str, flow_run_id: str) -> Path:
    """Note a node server a flow run starts, so its cancellation/crash hooks can stop it
    (they may run in another process, a worker's, so the note is a file, without secrets)."""
    folder = out / "node-servers" / flow_run_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps({"node": node.model_dump(), "server_dir": server_dir}))
    return path


def stop_node_servers(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: stop the node servers the run left (the lease would, later)."""
    from prefect.logging.loggers import flow_run_logger

    log = flow_run_logger(flow_run, flow)
    out = Path((flow_run.parameters.get("params") or {}).get("out", ExtractParameters().out)).resolve()
    for path in sorted((out / "node-servers" / str(flow_run.id)).glob("*.json")):
        record = json.loads(path.read_text())
        with SshNode(NodeOptions(**record["node"]).ssh_settings()) as node:
            node.prepare()
            answer = node.agent(["stop", "--server-dir", record["server_dir"]])
        log.info("%s: stopped server %s after the run ended as %s: %s", node.name, record["server_dir"],
                 state.name, answer["stop"])
        path.unlink()


# Bounded: the default thread pool is unbounded (prefect.md); it runs the per-sample retry tasks.
@flow(name="extract-eagle3", task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=False,
      on_cancellation=[stop_node_servers], on_crashed=[stop_node_servers])
def extract(params: ExtractParameters = ExtractParameters()) -> dict:
    log = get_run_logger()
    started = time.monotonic()
    phases_s: dict[str, float] = {}  # where the run's time went (the run report)
    out = Path(params.out).resolve()
    model_path, facts, tokenizer_dir = resolve_model(params)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    phases_s["model and tokenizer"] = time.monotonic() - started
    variables = params.template_variables()
    config = extraction_config(facts, params.aux_layers, params.dtype, template_hash(tokenizer),
                               params.max_length, params.on_overlong, params.store_dtype,
                               template_variables=variables.record())
    vdir = version_dir(out, config)
    retry_keys = recorded_failures(params.retry_failed_of, vdir) if params.retry_failed_of else None
    (vdir / "shards").mkdir(parents=True, exist_ok=True)
    # One run writes a version folder at a time (CLI runs, both deployments): an OS lock, dropped with the process.
    holder = lock_holder(flow_run=str(current_flow_run.id), name=current_flow_run.name)
    with version_lock(vdir, holder, params.version_wait_s,
                      on_wait=lambda other: log.warning("dataset version folder %s is being written by another run "
                                                        "(%s); waiting up to %.0f s", vdir, other,
                                                        params.version_wait_s)):
        log.info("dataset version %s in %s", config.fingerprint(), vdir)
        unfinished = remove_unfinished_shards(vdir)  # of killed runs: the lock says none is writing now
        if unfinished:
            log.info("removed %d unfinished shard files of an earlier run that was killed", unfinished)

        info = DatasetInfo(model=facts.name, layer_ids=list(config.layer_ids), layer_convention=config.layer_convention,
                           final_states=config.final_states, dtype=config.dtype, store_dtype=config.store_dtype,
                           hidden_size=facts.hidden_size,
                           num_layers=facts.num_layers, vocab_size=facts.vocab_size, template_hash=config.template_hash,
                           max_length=config.max_length, project_version=PROJECT_VERSION,
                           fingerprint=config.fingerprint(), template_variables=config.template_variables)
        # An export that cannot be made from this data must fail now, not after hours of extraction.
        check_exports(params.exports, info)
        draft_vocab_size_for(info, params.draft_vocab_size)

        mark = time.monotonic()
        prepared = prepare_step(Path(params.prompts), tokenizer, params.max_length, params.on_overlong, variables)
        write_rejects(vdir / "rejects.jsonl", prepared.rejected)
        done = {row["sample_key"] for row in shard_index(params, vdir, config.fingerprint())}
        todo = [s for s in prepared.samples if s.sample_key not in done]
        log.info("%d rows: %d samples (%d already extracted), %d duplicates, %d rejected",
                 prepared.rows_in, len(prepared.samples), len(prepared.samples) - len(todo),
                 len(prepared.duplicates), len(prepared.rejected))
        missing = len(todo)  # samples not in the version yet
        left_for_later: set[str] = set()
        if retry_keys is not None:
            left_for_later = {s.sample_key for s in todo if s.sample_key not in retry_keys}
            todo = [s for s in todo if s.sample_key in retry_keys]
            log.info("retrying %d failed samples of version %s; %d samples not in it yet are left for a later run",
                     len(todo), params.retry_failed_of, len(left_for_later))
            gone = retry_keys - done - {s.sample_key for s in prepared.samples}
            if gone:
                log.warning("%d failed samples of version %s are not in these prompts (e.g. %s)", len(gone),
                            params.retry_failed_of, sorted(gone)[:3])
        truncated = [s.source_id for s in prepared.samples if s.truncated]
        if truncated:
            log.warning("%d samples were cut to --max-length %d tokens (their ids: the run record)", len(truncated),
                        params.max_length)

        phases_s["prompt preparation"] = time.monotonic() - mark
        run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        failures: list[SampleFailure] = []
        new_tokens = 0
        extract_s = 0.0
        stages = StageTimes()  # inside the extraction: where the samples' time went (the run report)
        mark = time.monotonic()
        if todo:
            # One run at a time on a node, when its limit exists (README: "Runs sharing a GPU node").
            with node_slot(params.node.host_name(), params.node.lease_timeout_s) as waited_s:
                phases_s["waiting for the node"] = waited_s
                mark = time.monotonic()
                try:
                    new_tokens, failures, extract_s = run_extraction(params, model_path, out, vdir, run_id, todo,
                                                                     config.layer_ids, facts.hidden_size, stages)
                except RunFailed as exc:  # the run's record says so too; finished shards stay for a re-run
                    record = record_run(vdir, run_id, {
                        "run": run_id, "version": config.fingerprint(), "version_dir": str(vdir),
                        "rows_in": prepared.rows_in, "samples_to_extract": len(todo), "error": str(exc),
                        "wall_s": round(time.monotonic() - started, 2)}, [], truncated)
                    raise RunFailed(f"{exc}; run record {record}", record) from exc
        else:
            log.info("nothing new to extract: all %d samples are in dataset version %s",
                     len(prepared.samples), config.fingerprint())

        phases_s["extraction"] = time.monotonic() - mark
        failed_keys = {f.sample_key for f in failures}
        keep = {s.sample_key for s in prepared.samples if s.sample_key not in failed_keys | left_for_later}
        mark = time.monotonic()
        consolidated = finish_dataset(params, vdir, info, keep)
        phases_s["consolidation and exports"] = time.monotonic() - mark

        summary = {
            "run": run_id, "version": config.fingerprint(), "version_dir": str(vdir),
            "rows_in": prepared.rows_in, "written": len(keep), "written_this_run": len(todo) - len(failures),
            "already_present": len(prepared.samples) - missing, "duplicates": len(prepared.duplicates),
            "rejected": len(prepared.rejected), "failed": len(failures), "left_for_later": len(left_for_later),
            "truncated": len(truncated), "tokens_this_run": new_tokens,
            "dataset_tokens": consolidated.tokens, "dataset_bytes": consolidated.bytes,
            "tokens_per_s": round(new_tokens / extract_s, 1) if extract_s else 0.0,
            "wall_s": round(time.monotonic() - started, 2),
        }
        record = record_run(vdir, run_id, summary, failures, truncated)
        # Read back from the files, not derived from each other: a lost or extra sample is named here.
        reconcile(vdir, prepared, record, shards_here=not params.node.shards_remote or params.node.fetch,
                  left_for_later=left_for_later)
        # The UI's tables do not wrap and scroll sideways: counts first, long ids and paths last.
        create_table_artifact(key="extraction-summary", table=[dict(sorted(
            summary.items(), key=lambda item: item[0] in ("run", "version", "version_dir")))],
                              description=f"Dataset version {config.fingerprint()} in {vdir}")
        if failures:
            create_table_artifact(key="failed-samples", description="Samples that failed every attempt",
                                  table=[{"source_id": f.source_id, "error": f.error, "attempts": f.attempts,
                                          "reason": f.reason, "sample_key": f.sample_key} for f in failures])
        create_markdown_artifact(key="run-report", description=f"Run {run_id}: lengths, throughput, time",
                                 markdown=run_report(summary, [len(s.input_ids) for s in todo
                                                               if s.sample_key not in failed_keys], phases_s,
                                                     stages.seconds, stages.finished))
        log.info("summary: %s", json.dumps(summary))
        if len(failures) > failure_budget(params, len(todo)):
            raise RunFailed(f"{len(failures)} of {len(todo)} samples failed, over the failure budget of "
                            f"{failure_budget(params, len(todo))} (--max-failed-fraction {params.max_failed_fraction}); "
                            f"the written samples are in {vdir}, the failed ones in {record}", record)
        if not params.node.shards_remote or params.node.fetch:  # only a version whose shards are here loads here
            log.info("%s now points at dataset version %s", point_latest(out, vdir), config.fingerprint())
        return summary


def run_extraction(params: ExtractParameters, model_path: str, out: Path, vdir: Path, run_id: str,
                   todo: list, layer_ids: tuple[int, ...], hidden_size: int,
                   stages: StageTimes) -> tuple[int, list[SampleFailure], float]:
    """Start the server, extract every batch, retry stragglers, stop the server whatever happens."""
    if params.node.remote:
        return run_node_extraction(params, model_path, out, vdir, run_id, todo, layer_ids, hidden_size, stages)
    log = get_run_logger()
    dump_dir = out / "dumps"
    dump_dir.mkdir(parents=True, exist_ok=True)
    # Leftovers of killed runs: their rids carry other nonces and are never matched; clear them.
    stale = DumpReader(dump_dir).remove_stale(ttl_s=3600)
    if stale:
        log.info("removed %d stale dump files from %s", stale, dump_dir)

    config = server_config(params, model_path, dump_dir, layer_ids)

    def start(log_path: Path) -> RunningServer:
        return start_server(replace(config, instance=uuid.uuid4().hex), log_path,
                            ready_timeout_s=params.server.ready_timeout_s)

    def extract_with(server: RunningServer, todo: list, start_index: int) -> tuple[int, list[SampleFailure], float]:
        settings = retrieval_settings(params, server, server.url, layer_ids, hidden_size)
        return extract_here(params, settings, server, dump_dir, vdir, f"{run_id}-{start_index}", todo, stages)

    return with_restarts(params, vdir, run_id, todo, start, extract_with)


def with_restarts(params: ExtractParameters, vdir: Path, run_id: str, todo: list,
                  start: Callable[[Path], RunningServer],
                  extract_with: Callable[[RunningServer, list, int], tuple[int, list[SampleFailure], float]],
                  ) -> tuple[int, list[SampleFailure], float]:
    """``extract_with(server, todo, n)`` on the ``n``-th server ``start(log path)`` gives; a server that
    dies or hangs meanwhile (ServerDied) is started again, ``--server-restarts`` times, for the
    samples the version does not hold yet. Each server is stopped however its part ends. Each
    ``start`` gives the server a fresh launch nonce: pieces a dead server left are foreign to the next."""
    log = get_run_logger()
    started, tokens = time.monotonic(), 0
    for n in range(params.server_restarts + 1):
        server = start(vdir / "runs" / f"{run_id}-server{'' if n == 0 else f'-restart{n}'}.log")
        try:
            new_tokens, failures, _ = extract_with(server, todo, n)
            return tokens + new_tokens, failures, time.monotonic() - started
        except ServerDied as died:
            tokens += died.tokens
            log.error("%s; its log ends:\n%s", died, server.process.log_tail())
            if n == params.server_restarts:
                raise RunFailed(f"the server died {n + 1} times (--server-restarts {params.server_restarts}); "
                                f"last: {died}") from died
            done = {row["sample_key"] for row in shard_index(params, vdir, vdir.name)}
            todo = [s for s in todo if s.sample_key not in done]
            log.warning("restarting the server (%d of %d); %d samples to go", n + 1, params.server_restarts,
                        len(todo))
        finally:
            code = server.stop()
            log.info("server stopped (exit code %s); log %s", code, server.log_path)
    raise AssertionError("unreachable: the loop returns or raises")


def extract_here(params: ExtractParameters, settings: RetrievalSettings, server: RunningServer, dump_dir: Path,
                 vdir: Path, run_id: str, todo: list, stages: StageTimes) -> tuple[int, list[SampleFailure], float]:
    """Batches extracted by this machine (dumps in ``dump_dir``), shards written here.

    Raises ServerDied when the server exits meanwhile (what its batches wrote is kept). More
    failures than the failure budget are returned as they are, not retried one by one: a
    flood of per-sample tasks would not help and would swamp Prefect's server.
    """
    started = time.monotonic()
    batches = [todo[i:i + params.batch_size] for i in range(0, len(todo), params.batch_size)]
    limit = InFlightLimit(params.max_in_flight, params.max_dump_bytes_in_flight)
    runner = ThreadPoolTaskRunner(max_workers=params.concurrent_batches)
    watch = ServerWatch(server, limit.stop, health_timeout_s=params.server.health_timeout_s)
    processes = reader_process_count(params.reader_processes)
    readers = ReaderPool(processes) if processes else None
    with (tqdm(total=len(todo), unit="sample", desc="extracting") as bar, readers or contextlib.nullcontext(), runner,
          watch):
        try:
            futures = [runner.submit(extract_batch_step, parameters=dict(
                index=i, samples=quote(batch), settings=settings, dump_dir=dump_dir,
                shard_path=vdir / "shards" / f"shard-{run_id}-{i:05d}.safetensors",
                limit=limit, on_done=bar.update, store_dtype=params.store_dtype, times=stages,
                readers=readers))
                for i, batch in enumerate(batches)]
            results = batch_results(futures, batches, on_batch=stages.batch_finished)
        except BaseException as exc:  # Ctrl-C: nothing more is sent; the runner waits only for requests in flight
            limit.stop(f"the run was interrupted ({type(exc).__name__})")
            raise
    tokens = sum(r.shard.tokens for r in results if r.shard)
    if limit.stopped is not None or not server.process.alive():
        raise ServerDied(limit.stopped or f"the server on {server.host.name} exited", tokens)
    retried, failures = retry_stragglers(params, [f for r in results for f in r.failures], todo, retry_sample_step,
                                         lambda n: (settings, dump_dir,
                                                    vdir / "shards" / f"shard-{run_id}-retry-{n:05d}.safetensors",
                                                    params.store_dtype))
    return tokens + retried, failures, time.monotonic() - started


def batch_results(futures: list, batches: list[list], on_batch: Callable[[int], Any] | None = None) -> list:
    """The batch tasks' results, in batch order. As each finishes, the progress artifact (the UI's
    view of the terminal bar) moves, and ``on_batch(samples in it)`` is called."""
    samples = sum(map(len, batches))
    progress = create_progress_artifact(0.0, key="extraction-progress",
                                        description=progress_text(0, len(batches), 0, samples))
    size = {f.task_run_id: len(b) for f, b in zip(futures, batches)}
    samples_done = 0
    for n, future in enumerate(as_completed(futures), start=1):
        samples_done += size[future.task_run_id]
        if on_batch:
            on_batch(size[future.task_run_id])
        update_progress_artifact(progress, 100.0 * samples_done / samples,
                                 description=progress_text(n, len(batches), samples_done, samples))
    return [f.result() for f in futures]


def progress_text(batches_done: int, batches: int, samples_done: int, samples: int) -> str:
    return f"{batches_done} of {batches} batches finished ({samples_done} of {samples} samples)"


def retry_stragglers(params: ExtractParameters, stragglers: list[SampleFailure], todo: list, step,
                     step_args: Callable[[int], tuple]) -> tuple[int, list[SampleFailure]]:
    """Each sample its batch could not extract, in its own ``sample-<id>`` task with Prefect retries:
    ``step(sample, failure, *step_args(n))`` for straggler n, returning a ShardSummary."""
    if not stragglers:
        return 0, []
    if len(stragglers) > failure_budget(params, len(todo)):
        return 0, stragglers  # over the budget the run fails anyway; a task per sample would only flood Prefect
    by_key = {s.sample_key: s for s in todo}
    retry = step.with_options(retries=params.sample_retries, retry_delay_seconds=exponential_backoff(params.backoff_s))
    pending = [(f, retry.submit(quote(by_key[f.sample_key]), f, *step_args(n))) for n, f in enumerate(stragglers)]
    wait([p for _, p in pending])
    tokens, failures = 0, []
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
    return tokens, failures


def server_api_key(params: ExtractParameters) -> str | None:
    """The key the server requires: a Prefect Secret block (``--api-key-block``, else the node block's),
    a file (``--api-key-file``) or the ``EAGLE3_API_KEY`` environment variable; None without any.
    It reaches the server in its environment, never in a parameter, command line or log."""
    opts, log = params.server, get_run_logger()
    block = opts.api_key_block or (SshNodeBlock.load(params.node.block).api_key_block if params.node.block else None)
    if block:
        try:
            key = Secret.load(block).get()
        except ValueError as exc:
            raise ValueError(f"the server's API key: cannot load the Prefect Secret block {block!r}: {exc}") from exc
        log.info("server API key: from the Prefect Secret block %r", block)
        return key
    if opts.api_key_file:
        path = Path(opts.api_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"the server's API key: cannot read --api-key-file {path}: {exc}") from exc
        if not key:
            raise ValueError(f"the server's API key: --api-key-file {path} is empty")
        if path.stat().st_mode & 0o077:
            log.warning("server API key file %s can be read by other users (mode %o); chmod 600 it",
                        path, path.stat().st_mode & 0o777)
        log.info("server API key: from the file %s", path)
        return key
    if os.environ.get(API_KEY_ENV):
        log.info("server API key: from the environment variable %s", API_KEY_ENV)
    return os.environ.get(API_KEY_ENV) or None


def server_config(params: ExtractParameters, model_path: str, dump_dir: Path | str,
                  layer_ids: tuple[int, ...]) -> ServerConfig:
    opts = params.server
    if opts.allow_non_loopback and listen_hosts(opts.extra_args):
        get_run_logger().warning("the server will listen beyond loopback (%s): --allow-non-loopback is set; anyone "
                                 "who reaches the host can use it", ", ".join(listen_hosts(opts.extra_args)))
    return ServerConfig(model_path=Path(model_path), dump_dir=Path(dump_dir), rid_prefix=RID_PREFIX, port=opts.port,
                        aux_layer_ids=layer_ids, dtype=params.dtype, device=opts.device_or_default,
                        chunked_prefill_size=opts.chunked_prefill_size, disable_radix_cache=opts.disable_radix_cache,
                        skip_server_warmup=opts.skip_server_warmup,
                        # never below what the flow may have in flight: the writer must not refuse a piece the
                        # client has room for; the margin holds pieces of attempts the client gave up on
                        dump_max_pending_bytes=2 * params.max_dump_bytes_in_flight,
                        api_key=server_api_key(params), extra_args=tuple(opts.extra_args), engine=opts.engine,
                        allow_non_loopback=opts.allow_non_loopback)


def retrieval_settings(params: ExtractParameters, server: RunningServer, url: str, layer_ids: tuple[int, ...],
                       hidden_size: int) -> RetrievalSettings:
    """Requests to ``url`` (the server as reached from where the batches run); dumps accepted only
    from this server launch and model."""
    expected = ExpectedDump(tuple(layer_ids), hidden_size, params.dtype, model=str(server.config.model_path),
                            instance=server.config.instance)
    return RetrievalSettings(url=url, rid_prefix=RID_PREFIX, expected=expected,
                             headers=tuple(server.headers().items()), attempts=params.attempts,
                             backoff_s=params.backoff_s)


def run_node_extraction(params: ExtractParameters, model_path: str, out: Path, vdir: Path, run_id: str,
                        todo: list, layer_ids: tuple[int, ...], hidden_size: int, stages: StageTimes,
                        ) -> tuple[int, list[SampleFailure], float]:
    """A server on an SSH node. ``--shards-on node``: the batches run on the node too and the
    shards stay there. ``here``: requests go through a tunnel, dumps come over the connection
    (infra.ssh.DumpMirror) and the batches run here as with a local server.

    The server listens on the node's loopback: node-side batches reach it there, the flow
    through a tunnel. Its lease is renewed while the flow lives; it is stopped however
    the run ends (here, or by the cancellation/crash hooks, or by its lease running out).
    It is watched either way, and restarted like a local one when it dies or hangs.
    """
    log = get_run_logger()
    settings = params.node.ssh_settings()
    with SshNode(settings) as node:
        node.prepare()
        dump_dir = node.dump_dir
        host = SshHost(node, lease_timeout_s=params.node.lease_timeout_s)
        config = server_config(params, model_path, dump_dir, layer_ids)
        config = replace(config, port=config.port or host.free_port())
        try:
            facts = node.check(params.server.engine, params.server.device_or_default)
        except NodeCommandFailed as exc:
            raise NodeNotReady(f"{node.name} cannot run --engine {params.server.engine}: {exc.stderr.strip()}; "
                               f"the server would have been started with: "
                               f"{shlex.join(config.argv(settings.python, config.port))}"
                               ) from exc
        log.info("node %s: python %s, torch %s, GPUs %s, code in %s", node.name, facts["python_version"],
                 facts.get("torch"), facts.get("cuda_devices"), node.code_dir)
        node.run(["mkdir", "-p", dump_dir])
        records: list[Path] = []

        def start(log_path: Path) -> RunningServer:
            records.append(record_node_server(out, params.node, node.resolve(f"{settings.workdir}/servers/"
                                                                             f"{log_path.stem}"),
                                              str(current_flow_run.id)))
            return start_server(replace(config, instance=uuid.uuid4().hex), log_path, host=host,
                                ready_timeout_s=params.server.ready_timeout_s)

        def extract_with(server: RunningServer, todo: list, n: int) -> tuple[int, list[SampleFailure], float]:
            if params.node.shards_remote:
                on_node = retrieval_settings(params, server, f"http://127.0.0.1:{server.port}", layer_ids, hidden_size)
                return extract_on_node(params, node, server, on_node, dump_dir, node.version_dir(vdir.name),
                                       f"{run_id}-{n}", todo, stages)
            mirror_dir = out / "dumps" / f"from-{settings.host}-{server.port}"
            DumpReader(mirror_dir).remove_stale(ttl_s=0)  # an earlier run's leftovers: nobody reads them
            mirror = DumpMirror(node, dump_dir, mirror_dir, RID_PREFIX)
            try:
                return extract_here(params, retrieval_settings(params, server, server.url, layer_ids, hidden_size),
                                    server, mirror_dir, vdir, f"{run_id}-{n}", todo, stages)
            finally:
                mirror.stop()
                log.info("read %d dump files, %.1f MB, over SSH from %s (stream restarted %d times)",
                         mirror.files, mirror.bytes / 1e6, node.name, mirror.restarts)

        try:
            return with_restarts(params, vdir, run_id, todo, start, extract_with)
        finally:
            host.close()
            for record in records:
                record.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other servers of this run may still be noted there
                if records:
                    records[0].parent.rmdir()


def extract_on_node(params: ExtractParameters, node: SshNode, server: RunningServer, settings: RetrievalSettings,
                    dump_dir: str, node_vdir: str, run_id: str, todo: list,
                    stages: StageTimes) -> tuple[int, list[SampleFailure], float]:
    """Batches run on the node (``tasks.node_batch``), shards written there. Like :func:`extract_here`,
    raises ServerDied when the server exits or hangs meanwhile (the watch kills a hung one, so the
    node's requests fail at once instead of waiting out their timeouts)."""
    started = time.monotonic()
    batches = [todo[i:i + params.batch_size] for i in range(0, len(todo), params.batch_size)]
    runner = ThreadPoolTaskRunner(max_workers=params.concurrent_batches)
    watch = ServerWatch(server, lambda reason: None, health_timeout_s=params.server.health_timeout_s)
    with tqdm(total=len(todo), unit="sample", desc=f"extracting on {node.settings.host}") as bar, runner, watch:
        futures = [runner.submit(node_batch_step, parameters=dict(
            index=i, samples=quote(batch), settings=settings, node=node, dump_dir=dump_dir,
            shard_path=f"{node_vdir}/shards/shard-{run_id}-{i:05d}.safetensors", max_in_flight=params.max_in_flight,
            max_dump_bytes_in_flight=params.max_dump_bytes_in_flight, store_dtype=params.store_dtype,
            reader_processes=params.reader_processes))
            for i, batch in enumerate(batches)]
        results = batch_results(futures, batches, on_batch=lambda n: (bar.update(n), stages.batch_finished(n)))
    for r in results:
        stages.add(r.stage_s)
    tokens = sum(r.shard.tokens for r in results if r.shard)
    if watch.gone is not None or not server.process.alive():
        raise ServerDied(watch.gone or f"the server on {server.host.name} exited", tokens)
    retried, failures = retry_stragglers(params, [f for r in results for f in r.failures], todo,
                                         node_retry_sample_step, lambda n: (
                                             settings, node, dump_dir,
                                             f"{node_vdir}/shards/shard-{run_id}-retry-{n:05d}.safetensors"))
    return tokens + retried, failures, time.monotonic() - started


def record_run(vdir: Path, run_id: str, summary: dict, failures: list[SampleFailure], truncated: list[str]) -> Path:
    """``runs/<run>.json``: the summary, the failed samples with their reasons, the source ids of the
    samples cut to --max-length."""
    runs = vdir / "runs"
    runs.mkdir(exist_ok=True)
    path = runs / f"{run_id}.json"
    record = json.dumps({"summary": summary, "failed": [f.__dict__ for f in failures], "truncated": truncated},
                        indent=2)
    atomic_write(path, lambda tmp: tmp.write_text(record))
    return path


def recorded_failures(version: str, vdir: Path) -> set[str]:
    """Sample keys the runs of ``version`` recorded as failed (``record_run``); ``vdir`` is the version
    this run's parameters give, which must be that one."""
    if vdir.name != version:
        raise CannotRetry(f"--retry-failed-of {version}: these parameters give dataset version {vdir.name}; give "
                          f"the model, layers, dtypes, template, its variables and length rule of the failed run")
    records = sorted((vdir / "runs").glob("*.json"))
    if not records:
        raise CannotRetry(f"--retry-failed-of {version}: no run of it is recorded in {vdir / 'runs'}")
    keys = set()
    for path in records:
        try:
            keys |= {failure["sample_key"] for failure in json.loads(path.read_text())["failed"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CannotRetry(f"--retry-failed-of {version}: cannot read the run record {path}: {exc!r}") from exc
    return keys


#: Flags that differ from ``--<field-name>`` (the names SGLang and earlier releases gave them).
CLI = ModelCli(ExtractParameters, prog="python -m flows.extract", description=__doc__, rest="server.extra_args",
               flags={"node.block": "--node-block", "node.python": "--node-python",
                      "node.workdir": "--node-workdir", "node.dump_dir": "--node-dump-dir"})


def parse_args(argv: list[str] | None = None) -> ExtractParameters:
    return CLI.parse(argv)


def failure_lines(record: Path, limit: int = 20) -> list[str]:
    """One line per failed sample of a run record (the first ``limit``)."""
    failed = json.loads(record.read_text())["failed"]
    lines = [f"failed: sample {f['source_id']!r} (key {f['sample_key'][:12]}, {f['attempts']} attempts): "
             f"{f['error']}: {f['reason']}" for f in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"failed: {len(failed) - limit} more samples, listed in {record}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """The command line: the summary on stdout; on the terminal one line per failure, the tracebacks in the
    log file; exit 0 only when every sample was written, 130 when interrupted."""
    params = parse_args(argv)
    log_path = log_to_file(Path(params.out).resolve() / "logs")
    try:
        start_temporary_prefect_api()
        summary = extract(params)
    except (KeyboardInterrupt, TerminationSignal) as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, TerminationSignal) else "interrupted (Ctrl-C)"
        print(f"extract: {how}: the server is stopped; finished shards are kept and a re-run resumes them "
              f"(log {log_path})", file=sys.stderr)
        return 130
    except Exception as exc:
        FILE_ONLY.error("the run failed", exc_info=exc)  # the traceback, in the log file only
        if isinstance(exc, RunFailed) and exc.record is not None:
            print(*failure_lines(exc.record), sep="\n", file=sys.stderr)
        print(f"extract: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              f"(details in {log_path})", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    if summary["failed"]:
        print(*failure_lines(Path(summary["version_dir"]) / "runs" / f"{summary['run']}.json"), sep="\n",
              file=sys.stderr)
    # a script or a nightly job must be able to tell: any failed sample is a non-zero exit
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
