"""prefect.yaml deployed as a user deploys it: a real `prefect server start` on loopback, `prefect deploy`,
a process worker started outside the repo (so the pull step must find the code), `run_deployment`;
then everything is checked through the server's API, as the UI reads it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import requests
from prefect import get_client
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, FlowRunFilter,
                                           FlowRunFilterId)
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.parameters import REPO, ExtractParameters
from infra.server import free_port
from tasks.prompts import prompt_files
from tasks.retrieval import StageTimes
from tasks.shards import list_shards, read_shard_index
from tests.test_flow import conversations, write_jsonl

PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """`prefect server start` on loopback with its own PREFECT_HOME, the `local` process pool and
    `prefect deploy --all` from the repo; yields the environment that points the CLI and the worker at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLI_PROMPT": "false"}
    env.pop("PREFECT_PROFILES_PATH", None)
    log = (home / "server.log").open("wb")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, f"prefect server exited: {(home / 'server.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"prefect server not up in 120 s: {(home / 'server.log').read_text()}"
            time.sleep(0.5)
        cli(env, "work-pool", "create", "local", "--type", "process")
        cli(env, "--no-prompt", "deploy", "--all")
        with temporary_settings({PREFECT_API_URL: url}):
            yield env
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


def cli(env: dict, *args: str, cwd: Path = REPO, timeout: float = 300) -> str:
    run = subprocess.run([PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"prefect {' '.join(args)} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    return run.stdout


def test_deployed_extraction_runs_through_a_worker(deployed, tiny_model_dir, tmp_path):
    env = deployed
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(5))
    params = {"prompts": str(prompts), "model_path": str(tiny_model_dir), "out": str(tmp_path / "out"),
              "batch_size": 2, "concurrent_batches": 2}
    flow_run = run_deployment("extract-eagle3/extract", parameters={"params": params}, timeout=0)
    assert flow_run.state.is_scheduled()
    # Started outside the repo: only the deployment's pull step can lead it to flows/extract.py.
    worker = tmp_path / "worker"
    worker.mkdir()
    cli(env, "worker", "start", "--pool", "local", "--run-once", cwd=worker, timeout=400)

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run.id)
        assert flow_run.state.is_completed(), flow_run.state
        names = sorted(t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[flow_run.id]))))
        artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))}

    assert [n for n in names if n.startswith("batch-")] == ["batch-0000", "batch-0001", "batch-0002"]
    assert not [n for n in names if n.startswith("sample-")]  # nothing failed, nothing retried on its own
    (summary,) = json.loads(artifacts["extraction-summary"].data)
    assert (summary["rows_in"], summary["written"], summary["written_this_run"], summary["failed"]) == (5, 5, 5, 0)
    assert summary["tokens_this_run"] == summary["dataset_tokens"] > 0
    assert Path(summary["version_dir"]).is_relative_to(tmp_path / "out")
    progress = artifacts["extraction-progress"]
    assert (progress.type, progress.data) == ("progress", 100.0)
    assert progress.description == "3 of 3 batches finished (5 of 5 samples)"
    assert progress.updated > progress.created  # updated as batches finished, not written once at the end
    report = artifacts["run-report"]
    assert report.type == "markdown"
    counts = [int(row.split("|")[2]) for row in report.data.splitlines() if row.startswith("| ") and "-" in
              row.split("|")[1] and row.split("|")[2].strip().isdigit()]
    assert sum(counts) == 5  # the length histogram holds this run's samples
    assert f"{summary['tokens_this_run']:,} tokens" in report.data
    for phase in ("model and tokenizer", "prompt preparation", "extraction", "consolidation and exports"):
        assert f"| {phase} | " in report.data
    for stage in StageTimes.STAGES:  # inside the extraction: what the samples waited on
        assert f"| {stage} | " in report.data
    assert "## Throughput over time" in report.data and "| 3 | " in report.data  # a row per finished batch


def test_a_second_nightly_trigger_while_one_runs_is_cancelled(deployed, tiny_model_dir, tmp_path):
    """concurrency_limit 1 with CANCEL_NEW, as the server and the worker enforce it."""
    env = deployed
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(4))
    params = {"prompts": str(prompts), "model_path": str(tiny_model_dir), "out": str(tmp_path / "out")}
    runs = [run_deployment("extract-eagle3/nightly", parameters={"params": params}, timeout=0) for _ in range(2)]
    worker = tmp_path / "worker"
    worker.mkdir()
    cli(env, "worker", "start", "--pool", "local", "--run-once", cwd=worker, timeout=400)
    with get_client(sync_client=True) as client:
        states = sorted(client.read_flow_run(r.id).state.type.value for r in runs)
    assert states == ["CANCELLED", "COMPLETED"]
    (version,) = (tmp_path / "out" / "versions").iterdir()
    assert len(list((version / "runs").glob("*.json"))) == 1  # one run wrote the version


def run_through_worker(env: dict, deployment: str, params: dict, workdir: Path) -> dict:
    """One run of ``deployment`` by a worker started in ``workdir``; its extraction-summary."""
    flow_run = run_deployment(deployment, parameters={"params": params}, timeout=0)
    workdir.mkdir(exist_ok=True)
    cli(env, "worker", "start", "--pool", "local", "--run-once", cwd=workdir, timeout=400)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).state.is_completed()
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["extraction-summary"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    return json.loads(artifact.data)[0]


def test_nightly_on_a_growing_folder_extracts_only_the_new_files(deployed, tiny_model_dir, tmp_path):
    folder = tmp_path / "incoming"
    folder.mkdir()
    write_jsonl(folder / "2026-12-01.jsonl", conversations(3, tag="a"))
    params = {"prompts": str(folder), "model_path": str(tiny_model_dir), "out": str(tmp_path / "out")}
    first = run_through_worker(deployed, "extract-eagle3/nightly", params, tmp_path / "worker")
    assert (first["written_this_run"], first["already_present"], first["written"]) == (3, 0, 3)
    write_jsonl(folder / "2026-12-02.jsonl", conversations(2, tag="b"))
    second = run_through_worker(deployed, "extract-eagle3/nightly", params, tmp_path / "worker")
    assert (second["written_this_run"], second["already_present"], second["written"]) == (2, 3, 5)
    assert second["version"] == first["version"]


def test_retry_failed_deployment_extracts_only_the_failed_sample(deployed, tiny_model_dir, tmp_path):
    folder = tmp_path / "incoming"
    folder.mkdir()
    rows = conversations(5, tag="r")
    rows.insert(2, {"id": "too-long-for-server", "messages": [{"role": "user", "content": "tell me a story " * 400},
                                                              {"role": "assistant", "content": "no."}]})
    write_jsonl(folder / "2026-12-01.jsonl", rows)
    params = {"prompts": str(folder), "model_path": str(tiny_model_dir), "out": str(tmp_path / "out"),
              "max_length": 4000, "max_failed_fraction": 0.5}
    # The server refuses the long sample (its context is 512 tokens): a completed run with one failed sample.
    first = run_through_worker(deployed, "extract-eagle3/extract",
                               {**params, "server": {"extra_args": ["--context-length", "512"]}}, tmp_path / "worker")
    assert (first["written"], first["failed"]) == (5, 1)
    write_jsonl(folder / "2026-12-02.jsonl", conversations(2, tag="later"))  # new prompts: not the retry's business

    retry = run_through_worker(deployed, "extract-eagle3/retry-failed", {**params, "retry_failed_of": first["version"]},
                               tmp_path / "worker")
    assert retry["version"] == first["version"]
    assert (retry["written_this_run"], retry["failed"], retry["left_for_later"], retry["already_present"],
            retry["written"]) == (1, 0, 2, 5, 6)
    vdir = Path(first["version_dir"])
    # The retry's shards hold exactly the failed sample, and the manifest now holds all of the first run's rows.
    (failed_key,) = [f["sample_key"] for r in (vdir / "runs").glob("*.json") for f in json.loads(r.read_text())["failed"]]
    written = [row["sample_key"] for shard in list_shards(vdir) if retry["run"] in shard.name
               for row in read_shard_index(shard)]
    assert written == [failed_key]
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    assert sorted(manifest["source_id"]) == sorted(r["id"] for r in rows)
    assert os.readlink(tmp_path / "out" / "latest") == f"versions/{vdir.name}"


def test_nightly_deployment_is_registered_incremental_and_never_overlaps(deployed):
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(deployments) == {"extract", "nightly", "retry-failed"}
    nightly = deployments["nightly"]
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("0 2 * * *", "Europe/Berlin",
                                                                                     False)
    assert nightly.concurrency_options.collision_strategy == "CANCEL_NEW"
    assert nightly.global_concurrency_limit.limit == 1
    for deployment in deployments.values():
        # The code is found from the clone `prefect deploy` ran in, wherever the worker runs.
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {
            "directory": str(REPO)}}]
        assert deployment.work_pool_name == "local"
        parsed = ExtractParameters.model_validate(deployment.parameters.get("params", {}))
        assert prompt_files(REPO / parsed.prompts), f"{deployment.name}: no prompt file in {parsed.prompts}"
