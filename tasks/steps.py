"""The flow's steps as Prefect tasks: thin wrappers over the plain functions that do the work.

No tensors cross a task boundary: batches return shard paths and small summaries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import requests
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run as current_task_run

from patches.dumps import DumpReader
from tasks.consolidation import ConsolidationSummary, consolidate
from tasks.chat_template import TemplateVariables
from tasks.prompts import PreparedPrompts, prepare_prompts
from tasks.node_batch import failures_from_json, job_json
from tasks.readers import ReaderPool
from tasks.retrieval import (ConfigMismatch, InFlightLimit, PermanentFailure, RetrievalSettings, SampleError,
                             SampleFailure, StageTimes, extract_batch, extract_one)
from tasks.samples import PreparedSample
from tasks.shards import ShardSummary, write_shard
from tasks.training_set import DatasetInfo


@dataclass(frozen=True)
class BatchResult:
    index: int
    shard: ShardSummary | None
    failures: list[SampleFailure] = field(default_factory=list)
    #: seconds its samples spent per stage (tasks.retrieval.StageTimes), from a node's batch
    stage_s: dict[str, float] = field(default_factory=dict)


@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_step(prompts: Path, tokenizer, max_length: int, on_overlong: str,
                 variables: TemplateVariables) -> PreparedPrompts:
    prepared = prepare_prompts(prompts, tokenizer, max_length=max_length, on_overlong=on_overlong, variables=variables)
    get_run_logger().info("samples hold %d tool calls (supervised) and %d tool results (not supervised)",
                          prepared.tool_calls, prepared.tool_results)
    return prepared


@task(name="extract-batch", task_run_name="batch-{index:04d}", cache_policy=NO_CACHE)
def extract_batch_step(index: int, samples: list[PreparedSample], settings: RetrievalSettings, dump_dir: Path,
                       shard_path: Path, limit: InFlightLimit,
                       on_done: Callable[[], None] | None = None, store_dtype: str | None = None,
                       times: StageTimes | None = None, readers: ReaderPool | None = None) -> BatchResult:
    """Extract one batch into its shard. A configuration mismatch fails the batch (and the run)."""
    shard, failed = extract_batch(settings, DumpReader(dump_dir, settings.expected.instance), samples, limit,
                                  shard_path, store_dtype, on_done, priority=index, times=times, readers=readers)
    mismatch = next((f for f in failed if f.error == ConfigMismatch.__name__), None)
    if mismatch is not None:
        raise ConfigMismatch(mismatch.sample_key, mismatch.source_id, mismatch.reason)
    return BatchResult(index, shard, failed)


def _retry_if_retryable(task, task_run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    return isinstance(exc, SampleError) and exc.retryable


# Retries and their delays are the flow's parameters (``with_options``); only retryable errors retry.
@task(name="retry-sample", task_run_name="sample-{sample.source_id}", cache_policy=NO_CACHE,
      retry_jitter_factor=0.5, retry_condition_fn=_retry_if_retryable)
def retry_sample_step(sample: PreparedSample, failure: SampleFailure, settings: RetrievalSettings, dump_dir: Path,
                      shard_path: Path, store_dtype: str | None = None) -> ShardSummary:
    """A sample its batch could not extract, as its own graph node: one attempt per Prefect try.

    A permanent failure (bad input) is not sent again: the node fails at once with its reason.
    """
    if not failure.retryable:
        raise PermanentFailure(failure.sample_key, failure.source_id, f"{failure.error}: {failure.reason}")
    attempt = failure.attempts + current_task_run.run_count
    with requests.Session() as session:
        extracted = extract_one(settings, DumpReader(dump_dir, settings.expected.instance), sample, attempt, session)
    return write_shard(shard_path, [extracted], store_dtype)


@task(name="consolidate", cache_policy=NO_CACHE)
def consolidate_step(version_dir: Path, info: DatasetInfo, keep_keys: set[str], exports: list[str],
                     draft_vocab_size: int | None, index_rows: list[dict] | None = None) -> ConsolidationSummary:
    return consolidate(version_dir, info, keep_keys=keep_keys, exports=exports, draft_vocab_size=draft_vocab_size,
                       index_rows=index_rows)
# --------------------------------------------------------------------------- batches extracted on an SSH node


@task(name="extract-batch-on-node", task_run_name="batch-{index:04d}", cache_policy=NO_CACHE)
def node_batch_step(index: int, samples: list[PreparedSample], settings: RetrievalSettings, node, dump_dir: str,
                    shard_path: str, max_in_flight: int, max_dump_bytes_in_flight: int,
                    store_dtype: str | None = None, reader_processes: int | None = 0) -> BatchResult:
    """Run ``tasks.node_batch extract`` on the node: the shard stays there, its summary comes back.

    Safe to run again after a dropped connection (the node side keeps each batch's result).
    """
    job = job_json(settings, dump_dir, shard_path, max_in_flight, samples, max_dump_bytes_in_flight, store_dtype,
                   reader_processes)
    result = node.python_module("tasks.node_batch", ["extract"], stdin=json.dumps(job).encode())
    failed = failures_from_json(result)
    mismatch = next((f for f in failed if f.error == ConfigMismatch.__name__), None)
    if mismatch is not None:
        raise ConfigMismatch(mismatch.sample_key, mismatch.source_id, mismatch.reason)
    shard = ShardSummary(**result["shard"]) if result["shard"] else None
    return BatchResult(index, shard, failed, result["stage_s"])


@task(name="retry-sample-on-node", task_run_name="sample-{sample.source_id}", cache_policy=NO_CACHE,
      retry_jitter_factor=0.5, retry_condition_fn=_retry_if_retryable)
def node_retry_sample_step(sample: PreparedSample, failure: SampleFailure, settings: RetrievalSettings, node,
                           dump_dir: str, shard_path: str) -> ShardSummary:
    """``retry_sample_step`` for a node: one attempt per Prefect try, its shard (per try) on the node."""
    if not failure.retryable:
        raise PermanentFailure(failure.sample_key, failure.source_id, f"{failure.error}: {failure.reason}")
    attempt = failure.attempts + current_task_run.run_count
    path = shard_path.removesuffix(".safetensors") + f"-try{current_task_run.run_count}.safetensors"
    job = job_json(replace(settings, attempts=1), dump_dir, path, 1, [sample])
    result = node.python_module("tasks.node_batch", ["extract"], stdin=json.dumps(job).encode())
    if result["failures"]:
        (f,) = failures_from_json(result)
        exc = {c.__name__: c for c in SampleError.__subclasses__()}[f.error](f.sample_key, f.source_id, f.reason)
        exc.attempt = attempt
        raise exc
    return ShardSummary(**result["shard"])
