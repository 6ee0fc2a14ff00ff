"""The flow on a GPU node over SSH, against a real OpenSSH server on loopback (tests/sshd.py):
the transformers engine started on the "node" by the flow, host keys verified, commands quoted,
leases, dropped connections."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from transformers import AutoTokenizer

from flows.extract import extract
from flows.node import NodeNotReady
from flows.parameters import REPO, ExtractParameters, NodeOptions, ServerOptions
from infra.server import ServerConfig, ServerStartError
from infra.ssh import (HostKeyChanged, HostKeyUnknown, NodeCommandFailed, SshAuthFailed, SshHost, SshNode,
                        SshSettings)
from patches.launch import API_KEY_ENV, dump_arg_parser, plan_launch
from patches.sglang_releases import SUPPORTED_RELEASES
from tests.sshd import keygen
from tasks.training_set import TrainingSetDataset
from tests.ground_truth import load_reference_model, reference_hidden_states
from tests.test_flow import conversations, gone, independent_loss_mask, kill_the_server_after, write_jsonl


def node_options(sshd, workdir: Path, **kw) -> NodeOptions:
    return NodeOptions(node=sshd.url, ssh_key=str(sshd.user_key), known_hosts=str(sshd.known_hosts),
                       python=sys.executable, workdir=str(workdir), **kw)


def settings(sshd, workdir: Path, **kw) -> SshSettings:
    return replace(node_options(sshd, workdir).ssh_settings(), **kw)


def check_against_ground_truth(vdir: Path, rows: list[dict], model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reference_model(str(model_dir))
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    layer_ids = json.loads((vdir / "dataset.json").read_text())["layer_ids"]
    by_id = {r["id"]: r for r in rows}
    dataset = TrainingSetDataset(vdir)
    assert len(dataset) == len(rows) and manifest["sample_key"].n_unique() == len(rows)
    for i in range(len(dataset)):
        sample, source_id = dataset[i], manifest["source_id"][i]
        ids = sample["input_ids"].tolist()
        assert ids == tokenizer.apply_chat_template(by_id[source_id]["messages"], tokenize=True, return_dict=False)
        aux, final = reference_hidden_states(model, ids, layer_ids)
        assert (sample["aux_hidden_states"] - aux).abs().max() <= 1e-4, source_id
        assert (sample["hidden_states"] - final).abs().max() <= 1e-4, source_id
        assert sample["loss_mask"].tolist() == independent_loss_mask(tokenizer, by_id[source_id]["messages"], ids)


def test_flow_extracts_on_the_node_and_fetches_verified_shards(prefect_api, sshd, tiny_model_dir, tmp_path):
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(marker=marker)
    rows = conversations(11) + [{"id": hostile, "messages": [{"role": "user", "content": hostile},
                                                             {"role": "assistant", "content": hostile}]}]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    workdir = tmp_path / "node"
    params = ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"),
                               batch_size=5, server=ServerOptions(chunked_prefill_size=24), exports=["specforge"],
                               node=node_options(sshd, workdir))
    state = extract(params, return_state=True)
    summary = state.result()
    assert (summary["written"], summary["failed"], summary["rows_in"]) == (12, 0, 12)
    with get_client(sync_client=True) as client:
        (progress,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["extraction-progress"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert (progress.data, progress.description) == (100.0, "3 of 3 batches finished (12 of 12 samples)")
    assert progress.updated > progress.created, "the node's batches did not move the progress artifact"
    vdir = Path(summary["version_dir"])
    node_vdir = workdir / "versions" / vdir.name
    assert len(list((node_vdir / "shards").glob("*.safetensors"))) == 3, "the shards were not written on the node"
    assert not list((vdir / "shards").glob("*.safetensors")), "shards came home without --fetch"
    assert pl.read_parquet(vdir / "manifest.parquet").height == 12
    server_log = next((vdir / "runs").glob("*-server.log")).read_text()
    assert server_log.rstrip().endswith("node_agent: server exited with code 0"), server_log[-2000:]

    fetched = extract(params.model_copy(update={"node": node_options(sshd, workdir, fetch=True)}))
    assert (fetched["written_this_run"], fetched["already_present"], fetched["written"]) == (0, 12, 12)
    check_against_ground_truth(vdir, rows, tiny_model_dir)
    assert len(list((vdir / "exports" / "specforge").rglob("*.ckpt"))) == 12
    assert not marker.exists(), "a prompt ran a command on the node"



def test_a_hung_node_server_is_killed_and_restarted_and_nothing_is_lost(prefect_api, sshd, tiny_model_dir, tmp_path):
    """--shards-on node: the batches run on the node, so only the flow's watch can tell a hung
    server (its requests would wait out their 600 s timeouts, attempt after attempt). It is
    killed and started again, and every sample lands once."""
    rows = conversations(15, tag="node-hung")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    workdir, stopped = tmp_path / "node", []
    stopper = kill_the_server_after(workdir, shards=1, kills=stopped, sig=signal.SIGSTOP)  # alive, answers nothing
    started = time.monotonic()
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"),
                                        batch_size=3, max_in_flight=2, concurrent_batches=1, backoff_s=0.05,
                                        server=ServerOptions(health_timeout_s=2), node=node_options(sshd, workdir)))
    took = time.monotonic() - started
    stopper.join(5)
    assert len(stopped) == 1, "the node server was never stopped"
    assert took < 240, f"the run took {took:.0f}s: the hung server was not noticed"
    assert gone(stopped[0]), "the hung server was left running on the node"
    assert (summary["written"], summary["failed"], summary["written_this_run"]) == (15, 0, 15)
    vdir = Path(summary["version_dir"])
    assert len(list((vdir / "runs").glob("*-server-restart1.log"))) == 1
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    assert manifest.height == 15 and manifest["sample_key"].n_unique() == 15


def test_flow_extracts_here_through_a_tunnel_with_dumps_read_over_ssh(prefect_api, sshd, tiny_model_dir, tmp_path):
    """--shards-on here, with the connection cut once mid-run: the dump stream restarts and
    re-sends what was not acknowledged; every sample is written once and matches ground truth."""
    rows = conversations(14)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out, workdir = tmp_path / "out", tmp_path / "node"
    cuts: list[int] = []

    def cut_once():
        wait_for(lambda: len(list(out.glob("versions/*/shards/*.safetensors"))) >= 2, 240, "2 shards here")
        cuts.append(sshd.cut_connections())

    cutter = threading.Thread(target=cut_once, daemon=True)
    cutter.start()
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                        batch_size=2, max_in_flight=2, concurrent_batches=2,
                                        server=ServerOptions(chunked_prefill_size=24),
                                        node=node_options(sshd, workdir, shards_on="here")))
    cutter.join(10)
    assert cuts and cuts[0], "the connection was not cut mid-run"
    assert (summary["written"], summary["failed"], summary["written_this_run"]) == (14, 0, 14)
    assert not list(workdir.glob("versions/*/shards/*")), "shards were written on the node"
    assert not [p for p in (workdir / "dumps").iterdir()], "dump files were left on the node"
    check_against_ground_truth(Path(summary["version_dir"]), rows, tiny_model_dir)


# --------------------------------------------------------------------------- refusals


def test_unknown_host_key_is_refused_with_its_fingerprint(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyUnknown) as refused, SshNode(settings(sshd, tmp_path, known_hosts=empty)) as node:
        node.run(["true"])
    message = str(refused.value)
    assert sshd.host_key_fingerprint in message and f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {empty}" in message
    assert empty.read_text() == "", "the key was written to known_hosts"
    with pytest.raises(HostKeyUnknown, match="does not exist"), \
            SshNode(settings(sshd, tmp_path, known_hosts=tmp_path / "absent")) as node:
        node.run(["true"])


def test_changed_host_key_is_refused_with_both_fingerprints(sshd, tmp_path):
    keygen(tmp_path / "other")
    kind, blob = (tmp_path / "other.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {kind} {blob}\n")
    other_fp = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "other.pub")], capture_output=True, text=True,
                              check=True).stdout.split()[1]
    with pytest.raises(HostKeyChanged) as refused, SshNode(settings(sshd, tmp_path, known_hosts=known)) as node:
        node.run(["true"])
    assert sshd.host_key_fingerprint in str(refused.value) and other_fp in str(refused.value)
    assert f"ssh-keygen -R '[127.0.0.1]:{sshd.port}'" in str(refused.value)


def test_a_user_key_the_node_does_not_know_is_refused_clearly(sshd, tmp_path):
    keygen(tmp_path / "stranger")
    with pytest.raises(SshAuthFailed, match=r"user 'root' was refused with key SHA256:.*authorized_keys") as refused, \
            SshNode(settings(sshd, tmp_path, key_path=tmp_path / "stranger", user="root")) as node:
        node.run(["true"])
    assert "PRIVATE KEY" not in str(refused.value)


HOSTILE = "we ird; $(touch {marker}) `touch {marker}` 'q\"\nline2 && touch {marker}"


def test_hostile_values_run_nothing_on_the_node(sshd, tmp_path):
    marker = tmp_path / "pwned"
    hostile = HOSTILE.format(marker=marker)
    with SshNode(settings(sshd, tmp_path / hostile)) as node:
        node.prepare()
        assert node.run(["echo", hostile]).stdout.decode() == hostile + "\n"
        assert node.run(["ls", "-d", node.resolve(node.settings.workdir)]).code == 0
        node.run(["mkdir", "-p", node.dump_dir])
        assert Path(node.dump_dir).is_dir()
        with pytest.raises(NodeCommandFailed, match="has no config.json"):
            node.agent(["model-facts", "--model-path", hostile])
    with pytest.raises(NodeCommandFailed, match="exited 127"), \
            SshNode(settings(sshd, tmp_path, python=f"python3; touch {marker}")) as node:
        node.prepare()
    assert not marker.exists()


def test_a_server_that_fails_to_start_reports_its_log_tail(prefect_api, sshd, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(2))
    params = ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"),
                               server=ServerOptions(extra_args=["--no-such-flag"]),
                               node=node_options(sshd, tmp_path / "node"))
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="(?s)exited during start-up.*unrecognized arguments: --no-such-flag"):
        extract(params)
    assert time.monotonic() - started < 120, "the dead server was not noticed at once"


def test_sglang_engine_names_what_the_node_lacks_and_the_command_it_would_run(prefect_api, sshd, tiny_model_dir,
                                                                                tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(2))
    params = ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"),
                               server=ServerOptions(engine="sglang", extra_args=["--tp-size", "1"]),
                               node=node_options(sshd, tmp_path / "node"))
    with pytest.raises(NodeNotReady) as refused:
        extract(params)
    message = str(refused.value)
    assert "SGLang is not installed" in message and "a CUDA GPU" in message
    assert f"{sys.executable} -m patches.launch --dump-dir {tmp_path}/node/dumps" in message
    assert "--api-key" not in message and "s3cret" not in message  # the key goes in the environment


def test_sglang_command_line_passes_the_launchers_checks(tmp_path):
    config = ServerConfig(model_path=Path("/models/llama"), dump_dir=tmp_path, rid_prefix="eagle3-",
                          aux_layer_ids=(2, 4, 5), dtype="bfloat16", device="cuda", chunked_prefill_size=512,
                          dump_max_pending_bytes=6 << 30, extra_args=("--tp-size", "2"), engine="sglang")
    argv = config.argv("/opt/venv/bin/python", 31000)
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "patches.launch"]
    split = argv.index("--")
    plan = plan_launch(SUPPORTED_RELEASES["0.5.23"], dump_arg_parser().parse_args(argv[3:split]), argv[split + 1:],
                       model=("LlamaForCausalLM", 8))
    assert plan.hook_config.dump.layer_ids == (2, 4, 5) and plan.hook_config.dump.dump_dir == tmp_path.resolve()
    assert plan.hook_config.dump.max_pending_bytes == 6 << 30
    got = plan.argv
    for flag, value in (("--model-path", "/models/llama"), ("--host", "127.0.0.1"), ("--port", "31000"),
                        ("--dtype", "bfloat16"), ("--chunked-prefill-size", "512"), ("--tp-size", "2")):
        assert got[got.index(flag) + 1] == value, flag


# --------------------------------------------------------------------------- a connection cut, a killed flow


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return found


def test_a_connection_cut_mid_run_loses_and_duplicates_nothing(prefect_api, sshd, tiny_model_dir, tmp_path):
    rows = conversations(14)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    workdir = tmp_path / "node"
    cuts: list[int] = []

    def cut_twice():
        for shards in (1, 3):
            wait_for(lambda: len(list(workdir.glob("versions/*/shards/*.safetensors"))) >= shards, 240,
                     f"{shards} shards on the node")
            cuts.append(sshd.cut_connections())

    cutter = threading.Thread(target=cut_twice, daemon=True)
    cutter.start()
    summary = extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir),
                                        out=str(tmp_path / "out"), batch_size=2, max_in_flight=1,
                                        concurrent_batches=2, node=node_options(sshd, workdir, fetch=True)))
    cutter.join(10)
    assert len(cuts) == 2 and all(cuts), "the connections were not cut mid-run"
    assert (summary["written"], summary["failed"], summary["written_this_run"]) == (14, 0, 14)
    keys = [e["sample_key"] for shard in workdir.glob("versions/*/shards/*.safetensors")
            for e in json.loads(safe_metadata(shard)["samples"])]
    assert len(keys) == len(set(keys)) == 14, "a sample was extracted twice or lost"
    check_against_ground_truth(Path(summary["version_dir"]), rows, tiny_model_dir)


def safe_metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_a_killed_flow_leaves_no_server_on_the_node_after_its_lease(prefect_api, sshd, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(30))
    workdir, flow_log = tmp_path / "node", tmp_path / "flow.log"
    argv = [sys.executable, "-m", "flows.extract", "--prompts", str(prompts), "--model-path", str(tiny_model_dir),
            "--out", str(tmp_path / "out"), "--batch-size", "2", "--max-in-flight", "1", "--concurrent-batches", "1",
            "--node", sshd.url, "--ssh-key", str(sshd.user_key), "--known-hosts", str(sshd.known_hosts),
            "--node-python", sys.executable, "--node-workdir", str(workdir), "--lease-timeout-s", "4"]
    with open(flow_log, "wb") as log:
        flow = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: list(workdir.glob("versions/*/shards/*.safetensors")) or flow.poll() is not None, 240,
                 "a shard on the node")
        assert flow.poll() is None, flow_log.read_text()[-3000:]
    finally:
        os.killpg(flow.pid, signal.SIGKILL)
        flow.wait()
    (server_dir,) = (workdir / "servers").iterdir()
    pid = int((server_dir / "pid").read_text())
    from infra.node_agent import group_alive
    assert group_alive(pid), "the server was gone before the lease ran out"
    wait_for(lambda: not group_alive(pid), 4 + 30, "the server to stop after its lease ran out")
    log = (server_dir / "server.log").read_text()
    assert "lease not renewed" in log and "server exited with code 0" in log, log[-2000:]


# --------------------------------------------------------------------------- GBs over one connection


@pytest.fixture(scope="module")
def rekeying_sshd(tmp_path_factory):
    """An sshd that re-keys every 64 MB: paramiko was measured to die at re-key (shared/notes/ssh.md)."""
    from tests.sshd import start_sshd

    server = start_sshd(tmp_path_factory.mktemp("sshd-rekey"), rekey_limit="64M")
    yield server
    server.stop()


def test_gigabytes_cross_re_keys_and_a_cut_without_loss(rekeying_sshd, tmp_path):
    import hashlib
    import tempfile

    sshd = rekeying_sshd
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        shm = Path(shm)
        block = os.urandom(4 << 20)
        big = shm / "node-shard.bin"
        with open(big, "wb") as f:
            for i in range(300):  # 1.26 GB, every 4 MiB block tagged so a misplaced block shows
                f.write(i.to_bytes(4, "little") + block[4:])
        want = hashlib.sha256(big.read_bytes()).hexdigest()
        local = shm / "here" / "shard.bin"
        cuts: list[int] = []

        def cut_midway():
            part = local.with_name(f".{local.name}.part")
            wait_for(lambda: part.exists() and part.stat().st_size > 500 << 20, 120, "500 MB read")
            cuts.append(sshd.cut_connections())

        with SshNode(settings(sshd, tmp_path / "work")) as node:
            cutter = threading.Thread(target=cut_midway, daemon=True)
            cutter.start()
            assert node.read_file(str(big), local) == big.stat().st_size
            cutter.join(10)
            assert cuts and cuts[0] and node.reconnects >= 1, "the connection was not cut mid-file"
            assert hashlib.sha256(local.read_bytes()).hexdigest() == want
            big.unlink()
            local.unlink()

            node.prepare()
            from bench.ssh_transfer import make_pieces
            from infra.ssh import DumpMirror
            pieces = make_pieces(shm / "node-dumps", 1200, 4)
            sent = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in pieces}
            mirror = DumpMirror(node, str(shm / "node-dumps"), shm / "mirror", "eagle3-")
            wait_for(lambda: mirror.files >= len(pieces) or mirror.error, 300, "every dump file here")
            mirror.stop()
            got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (shm / "mirror").iterdir()}
            assert got == sent
            assert mirror.bytes >= 1200 << 20 and not list((shm / "node-dumps").iterdir())


# --------------------------------------------------------------------------- the node as a Prefect block


def test_node_block_is_saved_with_its_key_secret_and_chosen_by_name(prefect_api, sshd, tmp_path):
    from flows.extract import parse_args
    from infra.node_block import SshNodeBlock

    key = sshd.user_key.read_text()
    SshNodeBlock(node=sshd.url, ssh_key=key, known_hosts=str(sshd.known_hosts), python=sys.executable,
                 workdir=str(tmp_path / "work")).save("test-node", overwrite=True)
    params = parse_args(["--node-block", "test-node"])
    assert params.node.remote and params.node.shards_remote
    loaded = SshNodeBlock.load("test-node")
    assert key not in repr(loaded) and key not in json.dumps(params.model_dump(mode="json"))
    with SshNode(params.node.ssh_settings()) as node:
        assert node.run(["echo", "reached"]).stdout == b"reached\n"
        assert node.settings.key_text == key and key not in repr(node.settings)


# --------------------------------------------------------------------------- the node agent's start checks


def test_node_agent_refuses_a_busy_port_and_stops_a_server_an_earlier_run_left(sshd, tmp_path):
    import socket

    from infra.node_agent import group_alive

    with SshNode(settings(sshd, tmp_path / "work")) as node:
        node.prepare()
        servers = node.resolve(f"{node.settings.workdir}/servers")
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        web = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]
        with pytest.raises(NodeCommandFailed, match=f"port {port} on 127.0.0.1 is already in use"):
            node.agent(["start", "--server-dir", f"{servers}/a", "--port", str(port), "--lease-timeout-s", "60",
                        "--", *web, str(port)])
        busy.close()

        # An earlier run's server whose supervisor is gone too (a node reboot of the agent, an OOM kill):
        # nothing renews or watches its lease; the next start on the node finds and stops it.
        left = node.agent(["start", "--server-dir", f"{servers}/left", "--port", str(port), "--lease-timeout-s", "1",
                           "--", *web, str(port)])
        wait_for(lambda: (Path(servers) / "left" / "server_pid").exists(), 30, "the server's pid")
        os.kill(left["pid"], signal.SIGKILL)  # the supervisor only; the server runs on in its group
        assert group_alive(left["pid"])
        time.sleep(1.5)
        other = node.agent(["free-port"])["port"]
        answer = node.agent(["start", "--server-dir", f"{servers}/next", "--port", str(other),
                             "--lease-timeout-s", "60", "--", *web, str(other)])
        assert len(answer["stopped_leftovers"]) == 1 and "left (pid" in answer["stopped_leftovers"][0]
        assert not group_alive(left["pid"])
        assert node.agent(["stop", "--server-dir", f"{servers}/next"])["stop"] == "stopped by SIGTERM"



def test_crash_and_cancellation_hooks_stop_the_servers_a_run_noted(prefect_api, sshd, tmp_path):
    """What a worker does when it cancels a run or finds it crashed: the hook, in another process
    than the flow's, reads the run's notes and stops those servers at once (not at lease end)."""
    from prefect import get_client
    from prefect.states import Crashed

    from flows.node import record_node_server, stop_node_servers
    from infra.node_agent import group_alive

    out = tmp_path / "out"
    options = node_options(sshd, tmp_path / "work")
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(extract, parameters={"params": {"out": str(out)}})
    with SshNode(options.ssh_settings()) as node:
        node.prepare()
        host = SshHost(node, lease_timeout_s=600)
        port = host.free_port()
        process = host.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                             tmp_path / "run-server.log", port)
        node.stop_leases()  # the flow is gone: nobody renews
        record_node_server(out, options, process.server_dir, str(run.id))
        pid = int((Path(process.server_dir) / "pid").read_text())
        assert group_alive(pid)
    stop_node_servers(extract, run, Crashed())
    assert not group_alive(pid)
    assert not list((out / "node-servers" / str(run.id)).iterdir())



def test_node_flags_without_a_node_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="apply to an SSH node"):
        NodeOptions(shards_on="node")
    with pytest.raises(ValidationError, match="with --shards-on here they are here"):
        NodeOptions(node="ssh://me@gpu:22", shards_on="here", fetch=True)


def test_more_commands_at_once_than_sshd_sessions_wait_their_turn(sshd, tmp_path):
    """OpenSSH refuses an 11th session on one connection (MaxSessions 10): many batch tasks on
    one node must queue for a channel, not fail or tear the shared connection down."""
    from concurrent.futures import ThreadPoolExecutor

    with SshNode(settings(sshd, tmp_path / "work")) as node:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: node.run(["sh", "-c", f"sleep 0.5; echo {i}"]).stdout, range(16)))
        assert answers == [f"{i}\n".encode() for i in range(16)] and node.reconnects == 0


def test_a_node_server_gets_the_key_on_stdin_and_no_command_line_holds_it(sshd, tiny_model_dir, tmp_path):
    """sshd runs on this machine, so ``ps`` here sees the node's command lines too (the agent's, the
    supervisor's, the server's)."""
    import requests

    from infra.server import start_server
    from tests.test_safety import KEY, ProcessWatch

    (tmp_path / "dumps").mkdir()
    config = ServerConfig(model_path=tiny_model_dir, dump_dir=tmp_path / "dumps", rid_prefix="eagle3-", api_key=KEY,
                          skip_server_warmup=True)
    log_path = tmp_path / "runs" / "keyed-server.log"
    with SshNode(settings(sshd, tmp_path / "work")) as node, ProcessWatch(tmp_path) as watch:
        node.prepare()
        host = SshHost(node, lease_timeout_s=600)
        server = start_server(config, log_path, host=host, ready_timeout_s=120)
        try:
            assert requests.get(f"{server.url}/model_info", timeout=10).status_code == 401
            assert requests.get(f"{server.url}/model_info", headers=server.headers(), timeout=10).status_code == 200
            assert not (Path(server.process.server_dir) / "env.json").exists()  # read once by the supervisor
        finally:
            server.stop()
            host.close()
    assert watch.unauthorized == {401}
    assert any("infra.local_server" in line and str(tmp_path) in line for line in watch.lines)
    assert not [line for line in watch.lines if KEY in line]
    assert "node_agent: server exited with code 0" in log_path.read_text() and KEY not in log_path.read_text()
