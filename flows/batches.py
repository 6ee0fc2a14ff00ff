"""A run's batches through one server at a time: the server's settings, the batches
mapped onto tasks, the stragglers retried one by one, and a server that dies or hangs
started again for what is left."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.blocks.system import Secret
from prefect.futures import as_completed, wait
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff
from prefect.utilities.annotations import quote
from tqdm import tqdm

from flows.parameters import ExtractParameters, failure_budget
from infra.node_block import SshNodeBlock
from infra.server import RunningServer, ServerConfig, ServerWatch, listen_hosts
from infra.ssh import SshNode
from patches.dumps import RID_PREFIX
from patches.launch import API_KEY_ENV
from tasks.readers import ReaderPool, reader_process_count
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, SampleError, SampleFailure, StageTimes
from tasks.steps import extract_batch_step, retry_sample_step
from tasks.shards import list_shards, read_shard_index


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


def shard_index(params: ExtractParameters, vdir: Path, fingerprint: str) -> list[dict]:
    """Index rows of the version's finished shards, here or on the node (``--shards-on node``)."""
    if params.node.shards_remote:
        with SshNode(params.node.ssh_settings()) as node:
            node.prepare()
            return node.python_module("tasks.node_batch", ["index", "--version-dir", node.version_dir(fingerprint)])[
                "index"]
    return [row for shard in list_shards(vdir) for row in read_shard_index(shard)]


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
