"""Prompts in, a verified EAGLE-3 training set out.

    python -m flows.extract                      # the demo: tiny local model, demo prompts, ./out
    python -m flows.extract --prompts FILE --out DIR --model-path DIR [--chunked-prefill-size N] ...
    python -m flows.extract ... --engine sglang --node ssh://USER@HOST[:PORT] --ssh-key KEY \\
        --known-hosts FILE [--node-python PY] [--node-workdir DIR] [--node-dump-dir DIR] [-- SGLang flags]

Start the server, prepare prompts, map batches, retry stragglers one by one, consolidate,
stop the server however the run ends.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run as current_flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from transformers import AutoTokenizer

from flows.batches import RunFailed, extract_here, retrieval_settings, server_config, shard_index, with_restarts
from flows.cli import ModelCli
from flows.node import run_node_extraction, stop_node_servers
from flows.parameters import ExtractParameters, failure_budget
from flows.terminal import FILE_ONLY, log_to_file
from infra.prefect_api import start_temporary_prefect_api
from infra.node_slot import node_slot
from infra.server import RunningServer, start_server
from infra.ssh import SshNode
from infra.tiny_model import build_tiny_model
from patches.dumps import DumpReader
from tasks.accounting import reconcile
from tasks.dataset_version import (ModelFacts, extraction_config, lock_holder, read_model_facts, version_dir,
                                  version_lock)
from tasks.exports import check_exports
from tasks.chat_template import template_hash
from tasks.prompts import write_rejects
from tasks.report import run_report
from tasks.retrieval import SampleFailure, StageTimes
from tasks.steps import consolidate_step, prepare_step
from tasks.shards import remove_unfinished_shards
from tasks.training_set import DatasetInfo, atomic_write, point_latest
from tasks.vocab_mapping import draft_vocab_size_for


PROJECT_VERSION = "0.1.0"
#: the files of a model folder the flow machine needs (config and tokenizer), fetched from a node
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


class CannotRetry(ValueError):
    """--retry-failed-of names a version these parameters do not give, or one with no readable run records."""


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
