"""Runs that share a node take turns: the per-node global concurrency limit (infra/node_slot.py),
created with the README's command on a real Prefect API, with two flow runs started from a shell."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime, LogFilter, \
    LogFilterFlowRunId
from prefect.client.schemas.sorting import LogSort
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound

from flows.parameters import REPO
from infra.node_slot import node_limit_name
from tests.test_flow import conversations, write_jsonl
from tests.waiting import wait_for

PREFECT = str(Path(sys.executable).parent / "prefect")


def start_run(prompts: Path, model_dir: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.extract", "--prompts", str(prompts), "--model-path",
                             str(model_dir), "--out", str(out), "--batch-size", "4"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> dict:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return json.loads(output[output.rindex("\n{"):])


def active_slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def slot_log(flow_run_id) -> dict[str, tuple[datetime, str]]:
    """The flow run's node-slot log lines, by their first word: taking, holding, released."""
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)
    return {log.message.split()[0]: (log.timestamp, log.message) for log in logs
            if log.message.startswith(("taking a slot", "holding a slot", "released the slot"))}


def flow_runs_since(started: datetime) -> list:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=started)))


def test_two_runs_on_the_same_node_take_turns(prefect_api, tiny_model_dir, tmp_path):
    name = node_limit_name(socket.gethostname())  # both runs start their server on this machine
    created = subprocess.run([PREFECT, "gcl", "create", name, "--limit", "1"], capture_output=True, text=True,
                             timeout=120)
    assert created.returncode == 0, created.stdout + created.stderr
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(12))
    started = datetime.now(timezone.utc)
    try:
        # The test holds the node itself until both runs wait for it, so that they compete whatever the
        # machine's speed (a run of 12 tiny samples can end before a second process has started).
        with concurrency(name, occupy=1, lease_duration=60, strict=True):
            procs = [start_run(prompts, tiny_model_dir, tmp_path / "a"), start_run(prompts, tiny_model_dir, tmp_path / "b")]
            wait_for(lambda: sum("taking" in slot_log(r.id) for r in flow_runs_since(started)) >= 2, 300,
                     lambda: str([p.communicate()[0][-3000:] for p in procs if p.poll() is not None]),
                     alive=lambda: all(p.poll() is None for p in procs), poll_s=0.5)
            time.sleep(1.5)  # both wait, for longer than the check below
        summaries = [finish(p) for p in procs]
        assert active_slots(name) == 0, "a finished run kept its slot"
    finally:
        with get_client(sync_client=True) as client:
            try:
                client.delete_global_concurrency_limit_by_name(name)  # later tests run unlimited
            except ObjectNotFound:
                pass

    assert [s["written_this_run"] for s in summaries] == [12, 12]
    runs = flow_runs_since(started)
    assert len(runs) == 2
    first_log, second_log = sorted((slot_log(r.id) for r in runs), key=lambda log: log["holding"][0])
    assert set(first_log) == set(second_log) == {"taking", "holding", "released"}
    assert second_log["taking"][1] == first_log["taking"][1] == f"taking a slot of {name} (1 of 1 in use)"
    # The second run's server started only after the first run's servers had stopped.
    assert second_log["holding"][0] >= first_log["released"][0]
    assert second_log["taking"][0] < first_log["released"][0], "the runs never competed for the node"
    waited = float(second_log["holding"][1].split("waited ")[1].split(" s")[0])
    assert waited > 1.0
