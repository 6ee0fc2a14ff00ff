"""A run's server on a GPU node over SSH: started, watched and restarted like a local one,
its batches run here (dumps mirrored over the connection) or on the node, and stopped
however the run ends, by the flow's cancellation and crash hooks too."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
import uuid
from dataclasses import replace
from pathlib import Path

from prefect import get_run_logger
from prefect.runtime import flow_run as current_flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote
from tqdm import tqdm

from flows.batches import (RID_PREFIX, ServerDied, batch_results, extract_here, retrieval_settings, retry_stragglers,
                           server_config, with_restarts)
from flows.parameters import ExtractParameters, NodeOptions
from infra.server import RunningServer, ServerWatch, start_server
from infra.ssh import DumpMirror, NodeCommandFailed, SshError, SshHost, SshNode
from patches.dumps import DumpReader
from tasks.retrieval import RetrievalSettings, SampleFailure, StageTimes
from tasks.steps import node_batch_step, node_retry_sample_step


class NodeNotReady(SshError):
    """The node lacks what the chosen engine needs; the message names it and the command it would run."""


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
