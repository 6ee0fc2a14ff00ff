"""A run that keeps its secrets and its folder: the server's API key reaches the server and nothing else
(no command line, log, parameter, artifact or record), servers stay on loopback unless told otherwise,
one run writes a dataset version at a time, an empty input is an error, truncations are counted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import requests
from prefect import get_client
from prefect.blocks.system import Secret
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import FlowRunSort
from prefect.logging.handlers import APILogWorker
from transformers import AutoTokenizer

from flows.extract import extract
from flows.parameters import ExtractParameters, ServerOptions
from infra.server import NonLoopbackRefused, ServerConfig, start_server
from patches.launch import API_KEY_ENV, LaunchRefused, dump_arg_parser, plan_launch
from patches.sglang_releases import SUPPORTED_RELEASES
from tasks.dataset_version import LOCK_NAME, VersionBusy
from tasks.prompts import PromptFileError, prepare_prompts
from tests.test_flow import conversations, write_jsonl
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
KEY = "k3y-0f-th1s-test-7f3a9c"


class ProcessWatch:
    """Samples every command line on this machine (``ps``) while a run goes on, and asks the servers
    of this test (their command line names ``folder``) for ``/model_info`` without the key."""

    def __init__(self, folder: Path):
        self.folder, self.lines, self.unauthorized = str(folder), set(), set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for line in subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout.splitlines():
                self.lines.add(line)
                port = re.search(r" --port (\d+)", line)
                if self.folder in line and port:
                    try:
                        self.unauthorized.add(requests.get(f"http://127.0.0.1:{port[1]}/model_info", timeout=2).status_code)
                    except requests.RequestException:
                        pass  # not listening yet, or gone


def flow_run_texts(flow_run_id) -> list[str]:
    """What Prefect's API holds of a flow run: its parameters, its artifacts, its logs."""
    APILogWorker.drain_all(timeout=10)
    logs = []
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        while page := client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                       offset=len(logs)):
            logs += page
    assert artifacts and logs
    return [json.dumps(run.parameters), *(json.dumps(a.data) + (a.description or "") for a in artifacts),
            *(log.message for log in logs)]


def last_flow_run_id():
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0].id


@pytest.mark.parametrize("source", ["secret-block", "environment", "file"])
def test_the_api_key_reaches_the_server_and_nothing_else(source, prefect_api, tiny_model_dir, tmp_path,
                                                         monkeypatch):
    server = ServerOptions()
    if source == "secret-block":
        Secret(value=KEY).save("eagle3-test-api-key", overwrite=True)
        server = ServerOptions(api_key_block="eagle3-test-api-key")
    elif source == "environment":
        monkeypatch.setenv(API_KEY_ENV, KEY)
    else:
        (tmp_path / "key").write_text(KEY + "\n")
        (tmp_path / "key").chmod(0o600)
        server = ServerOptions(api_key_file=str(tmp_path / "key"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(4))
    params = ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir),
                               out=str(tmp_path / "out"), server=server, batch_size=2)
    with ProcessWatch(tmp_path) as watch:
        summary = extract(params)
    assert summary["written_this_run"] == 4 and summary["failed"] == 0
    assert watch.unauthorized == {401}, "the server did not require the key"
    assert any("infra.local_server" in line and str(tmp_path) in line for line in watch.lines)
    assert not [line for line in watch.lines if KEY in line], "the key was on a command line"
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.suffix in (".log", ".json", ".jsonl")]
    assert any(p.name.endswith("-server.log") for p in written) and any(p.parent.name == "runs" for p in written)
    assert not [p for p in written if KEY in p.read_text(errors="replace")]
    assert not [text for text in flow_run_texts(last_flow_run_id()) if KEY in text]


def test_a_saved_node_block_names_the_secret_block_and_the_flows_option_overrides_it(prefect_api, tmp_path):
    from prefect import flow

    from flows.batches import server_api_key
    from flows.parameters import NodeOptions
    from infra.node_block import SshNodeBlock

    Secret(value=KEY).save("eagle3-node-key", overwrite=True)
    Secret(value="another-key").save("eagle3-other-key", overwrite=True)
    SshNodeBlock(node="ssh://me@gpu:22", ssh_key="not a key", api_key_block="eagle3-node-key").save(
        "eagle3-keyed-node", overwrite=True)
    key_of = flow(server_api_key)
    node = NodeOptions(block="eagle3-keyed-node")
    assert key_of(ExtractParameters(node=node)) == KEY
    assert key_of(ExtractParameters(node=node, server=ServerOptions(api_key_block="eagle3-other-key"))) == "another-key"
    with pytest.raises(ValueError, match="cannot load the Prefect Secret block 'no-such-block'"):
        key_of(ExtractParameters(server=ServerOptions(api_key_block="no-such-block")))


def test_a_server_listens_beyond_loopback_only_when_allowed(tiny_model_dir, tmp_path):
    for engine in ("transformers", "sglang"):
        with pytest.raises(NonLoopbackRefused, match=r"listen beyond loopback \(0\.0\.0\.0\).*--allow-non-loopback"):
            ServerConfig(model_path=tiny_model_dir, dump_dir=tmp_path, rid_prefix="eagle3-", engine=engine,
                         extra_args=("--host", "0.0.0.0"))
    config = ServerConfig(model_path=tiny_model_dir, dump_dir=tmp_path / "dumps", rid_prefix="eagle3-",
                          skip_server_warmup=True, extra_args=("--host", "0.0.0.0"), allow_non_loopback=True)
    (tmp_path / "dumps").mkdir()
    server = start_server(config, tmp_path / "server.log", ready_timeout_s=120)
    try:
        listening = {(line.split()[1], line.split()[3]) for line in Path("/proc/net/tcp").read_text().splitlines()[1:]}
        assert (f"00000000:{server.port:04X}", "0A") in listening  # 0.0.0.0:port, LISTEN
    finally:
        server.stop()


# --------------------------------------------------------------------------- the SGLang launcher

#: SGLang itself needs a GPU stack; this stand-in has the four entry points patches.sglang_serve calls and
#: logs its ServerArgs at start-up as SGLang 0.5.17/0.5.23 do (engine.py: ``logger.info(f"{server_args=}")``).
FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/launch_server.py": """
        import hashlib, os, sys, time
        def run_server(server_args):
            print(f"server_args={server_args!r}", flush=True)
            ok = hashlib.sha256(server_args.api_key.encode()).hexdigest() == os.environ["EXPECTED_KEY_SHA256"]
            print("api key set in-process" if ok else "api key wrong", flush=True)
            print(f"child environment holds the key: {os.environ.get('EAGLE3_API_KEY') is not None}", flush=True)
            print(f"ready {os.getpid()}", flush=True)
            time.sleep(600)
        """,
    "sglang/srt/__init__.py": "",
    "sglang/srt/server_args.py": """
        import argparse
        def prepare_server_args(argv):
            p = argparse.ArgumentParser()
            p.add_argument("--api-key")
            return p.parse_known_args(argv)[0]
        """,
    "sglang/srt/plugins/__init__.py": "def load_plugins():\n    pass\n",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/common.py": "def kill_process_tree(parent_pid, include_parent=True):\n    pass\n",
    "sglang-0.5.17.dist-info/METADATA": "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n",
}


def test_the_sglang_launcher_keeps_the_key_off_its_command_line_and_out_of_its_log(tiny_model_dir, tmp_path):
    import hashlib

    site = tmp_path / "site"
    for name, text in FAKE_SGLANG.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text))
    (tmp_path / "dumps").mkdir()
    env = {**os.environ, API_KEY_ENV: KEY, "PYTHONPATH": str(site),
           "EXPECTED_KEY_SHA256": hashlib.sha256(KEY.encode()).hexdigest()}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "patches.launch", "--dump-dir", str(tmp_path / "dumps"),
                                     "--", "--model-path", str(tiny_model_dir), "--host", "127.0.0.1"],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "ready" in log_path.read_text(), 60, log_path.read_text, alive=lambda: launcher.poll() is None)
        command_lines = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
        assert "patches.sglang_serve" in command_lines and KEY not in command_lines
        launcher.terminate()  # the launcher alone, as a supervisor does: it passes SIGTERM on
        assert launcher.wait(30) == -signal.SIGTERM
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    log = log_path.read_text()
    assert "api key set in-process" in log and "child environment holds the key: False" in log
    assert "server_args=Namespace(api_key='***')" in log and KEY not in log


def test_the_launcher_refuses_a_key_among_the_sglang_flags(tmp_path):
    for flags in (["--api-key", KEY], [f"--admin-api-key={KEY}"], ["--api-k", KEY]):
        with pytest.raises(LaunchRefused, match=f"visible to every user of the node.*{API_KEY_ENV}") as refused:
            plan_launch(SUPPORTED_RELEASES["0.5.17"], dump_arg_parser().parse_args(["--dump-dir", str(tmp_path)]),
                        ["--model-path", "/m", *flags], model=("LlamaForCausalLM", 8))
        assert KEY not in str(refused.value)


# --------------------------------------------------------------------------- one run per version folder


def test_a_second_run_on_a_version_refuses_or_waits_and_a_killed_run_leaves_no_lock(prefect_api, tiny_model_dir,
                                                                                   tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(3))
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"))
    vdir = Path(extract(ExtractParameters(**base))["version_dir"])
    write_jsonl(prompts, conversations(3) + conversations(2, tag="more"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from tasks.dataset_version import "
         "version_lock\nwith version_lock(Path(sys.argv[1]), {'name': 'the-other-run', 'pid': 1234}):\n"
         "    print('locked', flush=True); time.sleep(600)", str(vdir)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        shards = sorted((vdir / "shards").iterdir())
        with pytest.raises(VersionBusy, match=f"dataset version folder {vdir} is being written by another run: "
                                              '.*"name": "the-other-run"'):
            extract(ExtractParameters(**base))
        assert sorted((vdir / "shards").iterdir()) == shards  # the refused run wrote nothing
        exports = subprocess.run([sys.executable, "-m", "tasks.exports", str(vdir), "specforge"], cwd=REPO,
                                 capture_output=True, text=True, timeout=300)
        assert exports.returncode == 1 and "the-other-run" in exports.stderr and not (vdir / "exports").exists()

        # Waiting: the other run is killed meanwhile; the kernel drops its lock with it.
        threading.Timer(3, holder.kill).start()
        started = time.monotonic()
        summary = extract(ExtractParameters(**base, version_wait_s=120))
        assert time.monotonic() - started > 3
    finally:
        holder.kill()
        holder.wait()
    assert (summary["written_this_run"], summary["written"], summary["already_present"]) == (2, 5, 3)
    assert json.loads((vdir / LOCK_NAME).read_text())["flow_run"] == str(last_flow_run_id())
    waited = [t for t in flow_run_texts(last_flow_run_id()) if "is being written by another run" in t]
    assert waited and "the-other-run" in waited[0] and "waiting up to 120 s" in waited[0]


# --------------------------------------------------------------------------- small ones


def test_an_empty_input_is_an_error_naming_it(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text("")
    (tmp_path / "folder" / "b.json").write_text("[]")
    for source in (tmp_path / "empty.jsonl", tmp_path / "folder"):
        with pytest.raises(PromptFileError, match=f"prompt file {source}: no rows"):
            prepare_prompts(source, tokenizer)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(PromptFileError, match=f"prompt file {tmp_path / 'nothing'}: folder holds no"):
        prepare_prompts(tmp_path / "nothing", tokenizer)


def test_truncated_samples_are_counted_listed_and_logged_once(prefect_api, tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"id": f"short{i}", "messages": [{"role": "user", "content": f"hi {i}"},
                                             {"role": "assistant", "content": "ok"}]} for i in range(3)]
    rows += [{"id": f"long{i}", "messages": [{"role": "user", "content": f"tell me {i}"},
                                            {"role": "assistant", "content": "more words " * 60}]} for i in range(2)]
    lengths = {r["id"]: len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False))
               for r in rows}
    over = sorted(i for i, n in lengths.items() if n > 64)
    assert over == ["long0", "long1"], lengths
    summary = extract(ExtractParameters(prompts=str(write_jsonl(tmp_path / "p.jsonl", rows)),
                                        model_path=str(tiny_model_dir), out=str(tmp_path / "out"), max_length=64))
    assert (summary["written"], summary["truncated"]) == (5, 2)
    record = json.loads((Path(summary["version_dir"]) / "runs" / f"{summary['run']}.json").read_text())
    assert sorted(record["truncated"]) == over and record["summary"]["truncated"] == 2
    logged = [t for t in flow_run_texts(last_flow_run_id()) if "cut to --max-length" in t]
    assert logged == ["2 samples were cut to --max-length 64 tokens (their ids: the run record)"]


def lock_pid(vdir: Path) -> int | None:
    """The pid the version's lock file names (its holder, or the last one)."""
    try:
        return json.loads((vdir / LOCK_NAME).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_two_real_runs_on_one_version_take_turns(prefect_api, tiny_model_dir, tmp_path):
    """A command-line run (its own process) holds the version; a run started meanwhile waits for it,
    then finds every sample written: one shard set, no sample twice."""
    import polars as pl

    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(2))
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"))
    vdir = Path(extract(ExtractParameters(**base))["version_dir"])
    write_jsonl(prompts, conversations(2) + conversations(6, tag="new"))
    log = tmp_path / "first-run.log"
    with open(log, "wb") as stderr:
        first = subprocess.Popen([sys.executable, "-m", "flows.extract", "--prompts", str(prompts), "--model-path",
                                  str(tiny_model_dir), "--out", str(tmp_path / "out"), "--batch-size", "2"],
                                 cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for(lambda: lock_pid(vdir) == first.pid, 300, lambda: log.read_text()[-3000:],
                 alive=lambda: first.poll() is None)
        second = extract(ExtractParameters(**base, version_wait_s=300))
        assert first.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    records = sorted((vdir / "runs").glob("*.json"), key=lambda p: p.stat().st_mtime)
    by_first = json.loads(records[-2].read_text())["summary"]
    assert (by_first["written_this_run"], second["written_this_run"], second["already_present"]) == (6, 0, 8)
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    assert manifest.height == 8 and manifest["sample_key"].n_unique() == 8
    waited = [t for t in flow_run_texts(last_flow_run_id()) if "is being written by another run" in t]
    assert waited and f'"pid": {first.pid}' in waited[0]
