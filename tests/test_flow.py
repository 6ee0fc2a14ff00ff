"""The extraction flow on the local server: verified tensors under an awkward server, resume by content,
versions by configuration, failures named and counted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import requests
import torch
from prefect import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
from transformers import AutoTokenizer

from flows.extract import extract
from flows.parameters import REPO, ExtractParameters, ServerOptions
from infra.server import free_port
from tasks.training_set import TrainingSetDataset
from tests.ground_truth import final_norm_input, load_reference_model, reference_hidden_states
from tests.test_exports import read_with_speculators, speculators_rows
from tests.waiting import wait_for


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversations(n: int, tag: str = "c") -> list[dict]:
    rows = []
    for i in range(n):
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": f"You are assistant number {i}."})
        for turn in range(1 + i % 3):
            msgs.append({"role": "user", "content": f"Question {turn} of {tag}{i}: " + "why is the sky blue? " * (1 + i % 5)})
            msgs.append({"role": "assistant", "content": f"Answer {turn}: " + "because light scatters. " * (1 + (i * 7) % 6)})
        rows.append({"id": f"{tag}{i}", "messages": msgs})
    return rows


def test_rerun_writes_nothing_new_and_new_layers_make_a_new_version(prefect_api, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(10))
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"), batch_size=4)
    first = extract(ExtractParameters(**base))
    assert first["written_this_run"] == 10
    shards = sorted((Path(first["version_dir"]) / "shards").iterdir())

    again = extract(ExtractParameters(**base))
    assert (again["written_this_run"], again["already_present"], again["written"]) == (0, 10, 10)
    assert sorted((Path(again["version_dir"]) / "shards").iterdir()) == shards

    grown = write_jsonl(tmp_path / "prompts.jsonl", conversations(10) + conversations(3, tag="new"))
    more = extract(ExtractParameters(**{**base, "prompts": str(grown)}))
    assert (more["written_this_run"], more["written"]) == (3, 13)

    other = extract(ExtractParameters(**base, aux_layers=[1, 3, 6]))
    assert other["version"] != first["version"] and other["written_this_run"] == 13
    assert json.loads((Path(other["version_dir"]) / "dataset.json").read_text())["layer_ids"] == [1, 3, 6]
    assert pl.read_parquet(Path(first["version_dir"]) / "manifest.parquet").height == 13

    # The chat template's variables are recorded, and another value is another version.
    recorded = json.loads((Path(first["version_dir"]) / "dataset.json").read_text())["template_variables"]
    assert recorded == {"date": "2024-07-26", "enable_thinking": True, "chat_template_kwargs": {}}
    dated = extract(ExtractParameters(**{**base, "prompts": str(grown)}, template_date="2025-01-01"))
    assert dated["version"] not in (first["version"], other["version"]) and dated["written_this_run"] == 13


def independent_loss_mask(tokenizer, messages: list[dict], input_ids: list[int]) -> list[int]:
    """Mask by rendering growing prefixes of the conversation and diffing their token counts.

    Tokens added by an assistant message, minus its header, are supervised: its content
    and the end-of-turn token. Valid for the tiny model's template, whose special tokens
    never merge with neighbouring text.
    """
    mask: list[int] = []
    header_len = len(tokenizer.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False))
    prev = 0
    for i, msg in enumerate(messages):
        n = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False))
        added = n - prev
        if msg["role"] == "assistant":
            mask += [0] * header_len + [1] * (added - header_len)
        else:
            mask += [0] * added
        prev = n
    return mask[: len(input_ids)]


@pytest.fixture
def foreign_traffic():
    """Other clients of the same server, as in production: a load balancer's health checks
    (real forwards) and two clients asking for the flow's own prompts without extra_key,
    so the prefix cache holds exactly those prompts while the flow runs."""
    target: dict = {"port": None, "prompts": [], "served": 0}
    stop = threading.Event()

    def health():
        while not stop.wait(0.02):
            if target["port"]:
                for route in ("/health", "/health_generate"):
                    try:
                        requests.get(f"http://127.0.0.1:{target['port']}{route}", timeout=20)
                    except requests.ConnectionError:
                        pass  # the server is not up yet, or already stopped

    def client(offset: int):
        n = offset
        while not stop.wait(0.01):
            if target["port"] and target["prompts"]:
                ids = target["prompts"][n % len(target["prompts"])]
                try:
                    r = requests.post(f"http://127.0.0.1:{target['port']}/generate", timeout=60,
                                      json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
                except requests.ConnectionError:
                    continue  # the server is not up yet, or already stopped
                target["served"] += r.status_code == 200
                n += 1

    threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in ((health, ()), (client, (0,)), (client, (5,)))]
    for t in threads:
        t.start()
    yield target
    stop.set()
    for t in threads:
        t.join(60)


def test_flow_writes_verified_samples_under_awkward_server(prefect_api, tiny_model_dir, tmp_path, foreign_traffic):
    rows = conversations(40)
    rows.append(dict(rows[5], id="same-content-as-c5"))          # a duplicate under another id
    rows.append({"id": "no-assistant", "messages": [{"role": "user", "content": "hello?"}]})
    rows.append("{not json")                                     # a malformed line
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    foreign_traffic["prompts"] = [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
                                  for r in rows[:10]]
    port = free_port()
    foreign_traffic["port"] = port
    params = ExtractParameters(
        prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"), batch_size=12,
        max_in_flight=8, max_dump_bytes_in_flight=1 << 28, concurrent_batches=2, exports=["specforge", "speculators"],
        server=ServerOptions(chunked_prefill_size=24, port=port, extra_args=["--dump-every-forward"]))
    summary = extract(params)
    server_log = next((tmp_path / "out").glob("versions/*/runs/*-server.log")).read_text()
    # the server's writer never refuses a piece the flow had room for: its budget is twice the flow's
    assert "'max_pending_bytes': 536870912" in server_log, server_log[-2000:]
    assert foreign_traffic["served"] >= 3, "the other client's requests never reached the server"

    assert summary["rows_in"] == 43
    assert (summary["written"], summary["duplicates"], summary["rejected"], summary["failed"]) == (40, 1, 2, 0)
    vdir = Path(summary["version_dir"])
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    assert manifest.height == 40 and manifest["sample_key"].n_unique() == 40
    rejects = [json.loads(line) for line in (vdir / "rejects.jsonl").read_text().splitlines()]
    assert {r["line"] for r in rejects} == {42, 43}

    model = load_reference_model(str(tiny_model_dir))
    layer_ids = json.loads((vdir / "dataset.json").read_text())["layer_ids"]
    by_id = {r["id"]: r for r in rows if isinstance(r, dict)}
    dataset = TrainingSetDataset(vdir)
    assert len(dataset) == 40
    for i in range(len(dataset)):
        sample = dataset[i]
        source_id = manifest["source_id"][i]
        ids = sample["input_ids"].tolist()
        assert ids == tokenizer.apply_chat_template(by_id[source_id]["messages"], tokenize=True, return_dict=False)
        aux, final = reference_hidden_states(model, ids, layer_ids)
        assert (sample["aux_hidden_states"] - aux).abs().max() <= 1e-4, source_id
        assert (sample["hidden_states"] - final).abs().max() <= 1e-4, source_id
        assert (sample["prenorm_hidden_states"] - final_norm_input(model, ids)).abs().max() <= 1e-4, source_id
        assert sample["loss_mask"].tolist() == independent_loss_mask(tokenizer, by_id[source_id]["messages"], ids)

    # speculators' released reader gets the PRE-norm final state of a direct forward (its trainer norms it)
    items, _ = read_with_speculators(vdir / "exports" / "speculators", tmp_path)
    for got, key in zip(items, speculators_rows(vdir)):
        ids = got["input_ids"].tolist()
        assert ids == dataset[manifest["sample_key"].to_list().index(key)]["input_ids"].tolist()
        aux, _ = reference_hidden_states(model, ids, layer_ids)
        assert (got["hidden_states"] - aux).abs().max() <= 1e-4, key
        assert (got["verifier_last_hidden_states"] - final_norm_input(model, ids)).abs().max() <= 1e-4, key


def start_flow_process(prompts: Path, model_dir: Path, out: Path, log_path: Path, shards: int,
                       env: dict[str, str] | None = None) -> subprocess.Popen:
    """The flow from a shell, small batches one at a time; returns once ``shards`` shards are written."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.extract", "--prompts", str(prompts), "--model-path",
                                 str(model_dir), "--out", str(out), "--batch-size", "3", "--max-in-flight", "1",
                                 "--concurrent-batches", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        wait_for(lambda: len(list(out.glob("versions/*/shards/*.safetensors"))) >= shards, 300,
                 lambda: f"the flow wrote fewer than {shards} shards (exit {proc.returncode}):\n"
                         f"{log_path.read_text()[-3000:]}", alive=lambda: proc.poll() is None, poll_s=0.05)
    except AssertionError:
        proc.kill()
        raise
    return proc


@pytest.fixture(scope="session")
def terminal_env(tmp_path_factory) -> dict[str, str]:
    """A user's shell: no PREFECT_API_URL, so the flow starts Prefect's temporary API server itself
    (one Prefect home for the session: its database is migrated once; slow to start on a busy machine)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300")
    return env


def process_tree(pid: int) -> dict[int, str]:
    """The process and its descendants (pid: command line), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            tree[p] = (Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            continue
        todo += children.get(p, [])
    return tree


def wait_gone(pids: dict[int, str], timeout: float) -> dict[int, str]:
    """The processes of ``pids`` still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = {p: cmd for p, cmd in pids.items() if not gone(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_flow_leaves_no_process_and_a_rerun_resumes(prefect_api, terminal_env, tiny_model_dir, tmp_path,
                                                              sig):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(30))
    out = tmp_path / "out"
    proc = start_flow_process(prompts, tiny_model_dir, out, tmp_path / "flow.log", shards=2, env=terminal_env)
    run = process_tree(proc.pid)
    assert any("infra.local_server" in cmd for cmd in run.values()) and any(
        "uvicorn" in cmd for cmd in run.values()), f"the model server or Prefect's API server is missing: {run}"
    os.kill(proc.pid, sig)  # `kill PID`: the flow alone, its children get no signal from us
    proc.wait(30)
    left = wait_gone(run, timeout=10)
    assert not left, f"outlived the {sig.name}ed flow: {left}"
    server_log = next(out.glob("versions/*/runs/*-server.log")).read_text()
    assert server_log.rstrip().endswith("stopped"), server_log[-2000:]  # drained and exited, not killed

    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                        batch_size=3))
    assert 6 <= summary["already_present"] < 30, "the kill did not land midway"
    assert summary["written_this_run"] == 30 - summary["already_present"]
    manifest = pl.read_parquet(Path(summary["version_dir"]) / "manifest.parquet")
    assert manifest.height == 30 and manifest["sample_key"].n_unique() == 30
    assert not list(out.glob("versions/*/shards/.*")), "a temporary shard file was left visible"


def test_ctrl_c_in_a_terminal_stops_within_seconds_with_one_line(terminal_env, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(30))
    out, flow_log = tmp_path / "out", tmp_path / "flow.log"
    proc = start_flow_process(prompts, tiny_model_dir, out, flow_log, shards=1, env=terminal_env)
    run = process_tree(proc.pid)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground group (Prefect's API server included)
    assert proc.wait(timeout=120) == 130
    took = time.monotonic() - sent
    left = wait_gone(run, timeout=5)
    assert not left, f"outlived the interrupted flow: {left}"
    assert took < 30, f"Ctrl-C took {took:.0f}s"
    terminal = flow_log.read_text()
    assert "Traceback" not in terminal, terminal[-3000:]
    assert terminal.count("extract: interrupted (Ctrl-C)") == 1, terminal[-3000:]
    assert "server stopped (exit code 0)" in terminal
    server_log = next(out.glob("versions/*/runs/*-server.log")).read_text()
    assert server_log.rstrip().endswith("stopped"), server_log[-2000:]
    assert not list(out.glob("versions/*/shards/.*")), "a temporary shard file was left visible"


def test_a_sample_the_server_refuses_fails_alone_and_is_named(prefect_api, tiny_model_dir, tmp_path):
    long_rows = conversations(6)
    long_rows[2] = {"id": "too-long-for-server", "messages": [
        {"role": "user", "content": "tell me a story " * 400}, {"role": "assistant", "content": "no."}]}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", long_rows)
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "o"),
                                        max_length=4000, max_failed_fraction=0.5,
                                        server=ServerOptions(extra_args=["--context-length", "512"])))
    assert (summary["written"], summary["failed"]) == (5, 1)
    run = json.loads(next(Path(summary["version_dir"], "runs").glob("*[0-9a-f].json")).read_text())
    assert [f["source_id"] for f in run["failed"]] == ["too-long-for-server"]
    assert run["failed"][0]["error"] == "ServerRejected" and run["failed"][0]["attempts"] == 1
    node = sample_task_run("too-long-for-server")
    assert node.state.is_failed() and node.run_count == 1, "bad input was retried"


def sample_task_run(source_id: str):
    """The flow-run graph's node for a failed sample, as the Prefect UI shows it.

    Task-run states reach the API as events, recorded a moment after the flow returns:
    wait for a final state rather than read a stale one.
    """
    name = f"sample-{source_id}"
    runs = []

    def final_run():
        runs[:] = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])))
        return runs[0] if len(runs) == 1 and runs[0].state is not None and runs[0].state.is_final() else None

    with get_client(sync_client=True) as client:
        return wait_for(final_run, 30, lambda: f"no final task run named {name}: {[(r.name, r.state) for r in runs]}",
                        poll_s=0.2)


def test_a_sample_whose_dump_keeps_failing_is_retried_in_its_own_task(prefect_api, tiny_model_dir, tmp_path):
    # The server's dump folder cap (1 MB) is below this sample's dump (~1.6 MB) and above
    # any other sample's: every attempt gets the writer's error marker instead of a dump.
    rows = conversations(6)
    rows[3] = {"id": "dump-too-big", "messages": [
        {"role": "user", "content": "tell me a story " * 400}, {"role": "assistant", "content": "no."}]}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    summary = extract(ExtractParameters(
        prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "o"), max_length=4000,
        max_in_flight=1, concurrent_batches=1, attempts=2, sample_retries=2, backoff_s=0.05, max_failed_fraction=0.5,
        server=ServerOptions(extra_args=["--dump-max-bytes", "1000000"])))
    assert (summary["written"], summary["failed"], summary["rows_in"]) == (5, 1, 6)
    run = json.loads(next(Path(summary["version_dir"], "runs").glob("*[0-9a-f].json")).read_text())
    (failure,) = run["failed"]
    assert failure["source_id"] == "dump-too-big" and failure["error"] == "DumpUnusable"
    assert "cap" in failure["reason"] and failure["attempts"] == 2 + 3
    node = sample_task_run("dump-too-big")
    assert node.state.is_failed() and node.run_count == 3
    assert not list((tmp_path / "o" / "dumps").iterdir()), "a failed attempt left files in the dump folder"


def test_float8_store_and_draft_vocabulary_from_the_command_line(prefect_api, tiny_model_dir, tmp_path):
    from flows.extract import parse_args

    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(6))
    params = parse_args(["--prompts", str(prompts), "--model-path", str(tiny_model_dir), "--out",
                         str(tmp_path / "out"), "--batch-size", "3", "--store-dtype", "float8_e4m3fn",
                         "--draft-vocab-size", "100"])
    summary = extract(params)
    vdir = Path(summary["version_dir"])
    data = json.loads((vdir / "dataset.json").read_text())
    assert (data["dtype"], data["store_dtype"], data["exports"]) == ("float32", "float8_e4m3fn", [])
    assert not (vdir / "exports").exists()  # no export unless asked: the shards are the one copy
    assert data["vocab_mapping"]["draft_vocab_size"] == 100
    assert torch.load(vdir / "vocab_mapping.pt", weights_only=True)["d2t"].shape == (100,)

    model = load_reference_model(str(tiny_model_dir))
    dataset = TrainingSetDataset(vdir)
    assert len(dataset) == 6
    for i in range(len(dataset)):
        sample = dataset[i]
        aux, final = reference_hidden_states(model, sample["input_ids"].tolist(), data["layer_ids"])
        prenorm = final_norm_input(model, sample["input_ids"].tolist())
        for got, want in ((sample["aux_hidden_states"], aux), (sample["hidden_states"], final),
                          (sample["prenorm_hidden_states"], prenorm)):
            got, want = got.float().reshape(-1, data["hidden_size"]), want.float().reshape(-1, data["hidden_size"])
            assert float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()) < 0.07  # float8: 3 mantissa bits


def kill_the_server_after(out: Path, shards: int, kills: list[int], times: int = 1,
                          sig: signal.Signals = signal.SIGKILL) -> threading.Thread:
    """Send ``sig`` to the flow's local server (found by its command line) once ``shards`` shards have been written
    since it started, ``times`` times; the pids signalled go to ``kills``. (A count of all shards would kill a
    restarted server during its start-up: the dead server's batch closes its shard with the samples it got.)"""
    def server_pids() -> list[int]:
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if b"infra.local_server" in cmd and str(out).encode() in b" ".join(cmd) and proc.name.isdigit():
                pids.append(int(proc.name))
        return pids

    def run():
        deadline = time.monotonic() + 300
        seen: dict[int, float] = {}  # server pid: when this thread first saw it (wall clock, as file times)
        while len(kills) < times and time.monotonic() < deadline:
            pids = server_pids()  # one listing: a server that starts between two would have no first sighting
            for pid in pids:
                seen.setdefault(pid, time.time())
            alive = [p for p in pids if p not in kills]
            if alive:
                since = seen[alive[0]]
                written = [p for p in out.glob("versions/*/shards/*.safetensors") if p.stat().st_mtime > since]
                if len(written) >= shards:
                    os.kill(alive[0], sig)
                    kills.append(alive[0])
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_server_killed_mid_run_is_restarted_and_nothing_is_lost(prefect_api, tiny_model_dir, tmp_path):
    rows = conversations(24)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out, kills = tmp_path / "out", []
    killer = kill_the_server_after(out, shards=2, kills=kills)
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                        batch_size=3, max_in_flight=2, concurrent_batches=1, backoff_s=0.05))
    killer.join(5)
    assert len(kills) == 1, "the server was never killed"
    assert (summary["written"], summary["failed"], summary["written_this_run"]) == (24, 0, 24)
    vdir = Path(summary["version_dir"])
    assert len(list((vdir / "runs").glob("*-server-restart1.log"))) == 1
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    assert manifest.height == 24 and manifest["sample_key"].n_unique() == 24
    model, layer_ids = load_reference_model(str(tiny_model_dir)), json.loads((vdir / "dataset.json").read_text())["layer_ids"]
    dataset = TrainingSetDataset(vdir)
    for i in range(len(dataset)):  # samples from before and after the restart: all the model's
        sample = dataset[i]
        aux, final = reference_hidden_states(model, sample["input_ids"].tolist(), layer_ids)
        assert (sample["aux_hidden_states"] - aux).abs().max() <= 1e-4
        assert (sample["hidden_states"] - final).abs().max() <= 1e-4


def test_a_server_that_keeps_dying_fails_the_run_without_a_task_flood(prefect_api, tiny_model_dir, tmp_path):
    from flows.batches import RunFailed

    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(24))
    out, kills = tmp_path / "out", []
    killer = kill_the_server_after(out, shards=1, kills=kills, times=2)
    started = time.monotonic()
    with pytest.raises(RunFailed, match="the server died 2 times") as failed:
        extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out), batch_size=3,
                                  max_in_flight=2, concurrent_batches=1, backoff_s=0.05, server_restarts=1))
    killer.join(5)
    record = json.loads(failed.value.record.read_text())  # a failed run still leaves its record, with the reason
    assert "the server died 2 times" in record["summary"]["error"] and record["summary"]["samples_to_extract"] == 24
    assert len(kills) == 2
    assert time.monotonic() - started < 180, "samples waited through their retries for a dead server"
    with get_client(sync_client=True) as client:
        retries = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[
            f"sample-c{i}" for i in range(24)])))
    assert retries == [], "per-sample retry tasks were spawned for a dead server"


def test_failures_past_the_budget_fail_the_run_and_spawn_no_sample_tasks(prefect_api, tiny_model_dir, tmp_path):
    from flows.batches import RunFailed

    rows = conversations(6, tag="budget")
    rows[1] = {"id": "over-budget", "messages": [
        {"role": "user", "content": "tell me a story " * 400}, {"role": "assistant", "content": "no."}]}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    with pytest.raises(RunFailed, match="1 of 6 samples failed, over the failure budget of 0"):
        extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "o"),
                                  max_length=4000, server=ServerOptions(extra_args=["--context-length", "512"])))
    run = json.loads(next((tmp_path / "o").glob("versions/*/runs/*[0-9a-f].json")).read_text())
    assert [f["source_id"] for f in run["failed"]] == ["over-budget"], "the failed sample was not recorded"
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["sample-over-budget"])))
    assert tasks == []


def test_a_sample_lost_between_extraction_and_the_check_is_named(prefect_api, tiny_model_dir, tmp_path, monkeypatch):
    import flows.extract as extract_module
    from tasks.accounting import AccountingError, reconcile
    from tasks.prompts import prepare_prompts

    rows = conversations(8, tag="acct")
    rows.append(dict(rows[2], id="copy-of-acct2"))
    rows.append("{not json")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    real_finish = extract_module.finish_dataset

    def finish_then_lose_a_row(params, vdir, info, keep):
        # Fault injection, not a mock: the real consolidation runs, then a manifest row goes missing
        # on disk, as a crashed or concurrent writer would leave it.
        done = real_finish(params, vdir, info, keep)
        manifest = pl.read_parquet(vdir / "manifest.parquet")
        manifest.filter(pl.col("source_id") != "acct5").write_parquet(vdir / "manifest.parquet")
        return done

    monkeypatch.setattr(extract_module, "finish_dataset", finish_then_lose_a_row)
    with pytest.raises(AccountingError, match=r"sample 'acct5' \(line 6, key [0-9a-f]{12}\) is in neither "
                                              r"manifest.parquet nor the failures of"):
        extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "o"),
                                  batch_size=4))
    monkeypatch.undo()

    # A clean re-run writes the manifest again from the shards: the files agree, and are read back.
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "o"),
                                        batch_size=4))
    assert (summary["written"], summary["duplicates"], summary["rejected"], summary["failed"]) == (8, 1, 1, 0)
    vdir = Path(summary["version_dir"])
    record = vdir / "runs" / f"{summary['run']}.json"
    prepared = prepare_prompts(prompts, AutoTokenizer.from_pretrained(tiny_model_dir), max_length=2048)
    assert reconcile(vdir, prepared, record).written == 8

    # each kind of damage is named: a sample whose shard is gone, an extra row, a failure that was written
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    lost_shard = manifest.filter(pl.col("source_id") == "acct1")["shard"][0]
    (vdir / "shards" / lost_shard).rename(tmp_path / lost_shard)
    with pytest.raises(AccountingError, match=rf"sample 'acct1' \(key [0-9a-f]{{12}}\): its shard \S+{lost_shard} "
                                              r"is missing"):
        reconcile(vdir, prepared, record)
    (tmp_path / lost_shard).rename(vdir / "shards" / lost_shard)
    extra = manifest.head(1).with_columns(pl.lit("stranger").alias("source_id"), pl.lit("f" * 32).alias("sample_key"))
    pl.concat([manifest, extra]).write_parquet(vdir / "manifest.parquet")
    with pytest.raises(AccountingError, match="manifest.parquet row 'stranger' .* is no sample of the input"):
        reconcile(vdir, prepared, record)
    manifest.write_parquet(vdir / "manifest.parquet")
    written = manifest.row(0, named=True)
    record.write_text(json.dumps({"summary": {}, "failed": [{"sample_key": written["sample_key"],
                                                             "source_id": written["source_id"]}]}))
    with pytest.raises(AccountingError, match=f"sample '{written['source_id']}' .* is both in manifest.parquet and "
                                              "among the failures"):
        reconcile(vdir, prepared, record)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_hung_server_is_killed_and_restarted_and_nothing_is_lost(prefect_api, tiny_model_dir, tmp_path, caplog):
    rows = conversations(24, tag="hung")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out, stopped = tmp_path / "out", []
    stopper = kill_the_server_after(out, shards=2, kills=stopped, sig=signal.SIGSTOP)  # alive, answers nothing
    started = time.monotonic()
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                        batch_size=3, max_in_flight=2, concurrent_batches=1, backoff_s=0.05,
                                        server=ServerOptions(health_timeout_s=2)))
    took = time.monotonic() - started
    stopper.join(5)
    assert len(stopped) == 1, "the server was never stopped"
    assert took < 150, f"the run took {took:.0f}s: the hung server was not noticed"
    assert gone(stopped[0]), "the hung server was left running"
    assert (summary["written"], summary["failed"], summary["written_this_run"]) == (24, 0, 24)
    vdir = Path(summary["version_dir"])
    assert len(list((vdir / "runs").glob("*-server-restart1.log"))) == 1
    hung = [r.getMessage() for r in caplog.records if "is hung" in r.getMessage()]
    assert hung and "/health failed 2 times in a row" in hung[0] and "its log ends" in hung[0], hung
    model, layer_ids = load_reference_model(str(tiny_model_dir)), json.loads((vdir / "dataset.json").read_text())["layer_ids"]
    dataset = TrainingSetDataset(vdir)
    assert len(dataset) == 24
    for i in range(len(dataset)):
        sample = dataset[i]
        aux, final = reference_hidden_states(model, sample["input_ids"].tolist(), layer_ids)
        assert (sample["aux_hidden_states"] - aux).abs().max() <= 1e-4
        assert (sample["hidden_states"] - final).abs().max() <= 1e-4


def test_a_hung_server_past_the_restart_budget_fails_the_run_with_the_reason(prefect_api, tiny_model_dir, tmp_path):
    from flows.batches import RunFailed

    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(24, tag="hung0"))
    out, stopped = tmp_path / "out", []
    stopper = kill_the_server_after(out, shards=1, kills=stopped, sig=signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RunFailed, match=r"the server died 1 times \(--server-restarts 0\); last: the server on "
                                        r"localhost port \d+ \(log .*\) is hung: /health failed 2 times"):
        extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out), batch_size=3,
                                  max_in_flight=2, concurrent_batches=1, backoff_s=0.05, server_restarts=0,
                                  server=ServerOptions(health_timeout_s=2)))
    stopper.join(5)
    assert time.monotonic() - started < 120
    assert len(stopped) == 1 and gone(stopped[0]), "the hung server was left running"


def run_cli(args: list[str], log_path: Path, timeout: float = 300) -> tuple[int, str]:
    """``python -m flows.extract ARGS`` as from a shell (against the test's Prefect API); (exit code, terminal)."""
    with open(log_path, "wb") as log:
        code = subprocess.run([sys.executable, "-m", "flows.extract", *args], cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode
    return code, log_path.read_text()


def test_a_failed_run_prints_one_line_per_failure_and_keeps_the_traceback_in_the_log(prefect_api, tiny_model_dir,
                                                                                      tmp_path):
    rows = conversations(6, tag="line")
    rows[2] = {"id": "too-long", "messages": [
        {"role": "user", "content": "tell me a story " * 400}, {"role": "assistant", "content": "no."}]}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out"
    code, terminal = run_cli(["--prompts", str(prompts), "--model-path", str(tiny_model_dir), "--out", str(out),
                              "--max-length", "4000", "--", "--context-length", "512"], tmp_path / "terminal.txt")
    assert code == 1
    assert "Traceback" not in terminal, terminal[-4000:]
    (failed,) = [line for line in terminal.splitlines() if line.startswith("failed: ")]
    assert failed.startswith("failed: sample 'too-long' (key ") and "ServerRejected" in failed
    assert "longer than the model's context length (512 tokens)" in failed
    (last,) = [line for line in terminal.splitlines() if line.startswith("extract: failed: ")]
    assert last.startswith("extract: failed: RunFailed: 1 of 6 samples failed, over the failure budget of 0")
    assert terminal.count("over the failure budget") == 1, "the run's failure was repeated on the terminal"
    assert terminal.count("longer than the model's context length") == 1, "the sample's failure was repeated"
    (log_file,) = (out / "logs").glob("extract-*.log")
    log = log_file.read_text()
    assert str(log_file) in last and "Traceback" in log and "RunFailed" in log
    assert "attempt 1 of 3: ServerRejected" in log, "the per-attempt warning is missing from the log file"


def test_a_full_output_disk_names_the_shard_and_a_rerun_completes(prefect_api, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(12, tag="full"))
    out = tmp_path / "out"
    versions = out / "versions"
    versions.mkdir(parents=True)
    # A real small filesystem for the dataset versions (the dumps and the log stay on the big disk).
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(versions)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    try:
        code, terminal = run_cli(["--prompts", str(prompts), "--model-path", str(tiny_model_dir), "--out", str(out),
                                  "--batch-size", "2", "--concurrent-batches", "1"], tmp_path / "terminal.txt")
        assert code == 1
        assert "Traceback" not in terminal, terminal[-4000:]
        (last,) = [line for line in terminal.splitlines() if line.startswith("extract: failed: ")]
        assert re.search(rf"ShardWriteFailed: \[Errno 28\] cannot write shard {re.escape(str(versions))}/\w+/shards/"
                         r"shard-[\w-]+\.safetensors: No space left on device", last), last
        assert not list(versions.glob("*/shards/.*")), "a temporary shard file was left behind"

        subprocess.run(["mount", "-o", "remount,size=64m", str(versions)], check=True)  # space freed
        summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                            batch_size=2))
        assert (summary["written"], summary["failed"]) == (12, 0)
        assert summary["already_present"] > 0, "the shards written before the disk was full were not kept"
        manifest = pl.read_parquet(Path(summary["version_dir"]) / "manifest.parquet")
        assert manifest.height == 12 and manifest["sample_key"].n_unique() == 12
    finally:
        subprocess.run(["umount", "-l", str(versions)], check=False)
