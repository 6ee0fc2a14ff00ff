"""The node side of a server's lifecycle, run over SSH as ``python -m infra.node_agent VERB ...``.

Each verb prints one JSON object on stdout and exits 0, or prints the reason on stderr and
exits 2. The flow builds every invocation from an argv list (``shlex.join``), so no value
it passes is ever read by a shell here.

    check --engine E --device D      Python, torch, the SGLang release (the launcher's check), the GPU
    free-port                        a free loopback port
    model-facts --model-path P       layer count, hidden size, identity hash of a model folder
    start --server-dir D --port N --lease-timeout-s T -- ARGV...   (stdin: {"env": {NAME: VALUE}})
                                     start ARGV detached (its own session and process group) under a
                                     supervisor that stops it when the lease file goes stale; the
                                     environment additions (the API key) come on stdin, never in argv
    status --server-dir D            alive or not, exit code, the log's tail
    stop --server-dir D --grace-s G  SIGTERM the group, SIGKILL after G seconds (idempotent)

A server folder holds ``server.log``, ``pid`` (the supervisor's pid = the process group id),
``lease`` (its mtime, on the node's clock, is the last renewal: the flow touches it), ``lease_timeout_s``, ``port``,
``argv.json``, until the supervisor has read it ``env.json`` (mode 0600: it may hold the API
key) and, once the server has exited, ``exit``. Several servers (of one run or of
several runs) live side by side under one ``servers/`` folder: nothing here assumes one.

Standard library only (``check`` imports torch, and reads the SGLang version without
importing SGLang): this runs on a GPU node that has only what SGLang brings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

LOG_NAME = "server.log"
#: how often the supervisor looks at its server and its lease
SUPERVISE_POLL_S = 0.5


class AgentError(Exception):
    """A verb could not do what was asked; the message is the whole answer."""


# --------------------------------------------------------------------------- process groups


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is alive (zombies do not count: no reaper may exist)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(pgid: int, grace_s: float) -> str:
    """SIGTERM the group, wait up to ``grace_s``, then SIGKILL. Returns how it ended."""
    if not group_alive(pgid):
        return "not running"
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return "stopped by SIGTERM"
        time.sleep(0.1)
    _killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "killed (SIGKILL)"


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- server folders


def read_pid(server_dir: Path) -> int | None:
    try:
        return int((server_dir / "pid").read_text())
    except FileNotFoundError:
        return None


def lease_age_s(server_dir: Path) -> float:
    try:
        return time.time() - (server_dir / "lease").stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def lease_timeout_s(server_dir: Path) -> float:
    try:
        return float((server_dir / "lease_timeout_s").read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def log_tail(server_dir: Path, max_bytes: int = 4000) -> str:
    try:
        with open(server_dir / LOG_NAME, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def status(server_dir: Path, tail_bytes: int = 4000) -> dict:
    pid = read_pid(server_dir)
    exit_file = server_dir / "exit"
    return {"server_dir": str(server_dir), "pid": pid, "alive": pid is not None and group_alive(pid),
            "exit": exit_file.read_text().strip() if exit_file.exists() else None,
            "lease_age_s": round(lease_age_s(server_dir), 1), "log_tail": log_tail(server_dir, tail_bytes)}


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def sweep_leftovers(servers_root: Path, keep: Path) -> tuple[list[str], list[dict]]:
    """Stop servers whose lease has run out (their flow is gone, their supervisor too: it would
    have stopped them); list the live ones another run still renews."""
    stopped, running = [], []
    if not servers_root.is_dir():
        return stopped, running
    for server_dir in sorted(p for p in servers_root.iterdir() if p.is_dir() and p != keep):
        pid = read_pid(server_dir)
        if pid is None or not group_alive(pid):
            continue
        port = (server_dir / "port").read_text().strip() if (server_dir / "port").exists() else "?"
        if lease_age_s(server_dir) > lease_timeout_s(server_dir):
            how = stop_group(pid, grace_s=10)
            stopped.append(f"{server_dir.name} (pid {pid}, port {port}, lease {lease_age_s(server_dir):.0f}s old): {how}")
        else:
            running.append({"server": server_dir.name, "pid": pid, "port": port})
    return stopped, running


ENV_NAME = "env.json"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only, from the first byte on."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def start(server_dir: Path, port: int, lease_timeout: float, argv: list[str], env: dict[str, str]) -> dict:
    """Start ``argv`` (with ``env`` added to its environment) under a supervisor; idempotent for a
    server folder whose server runs already."""
    if not argv:
        raise AgentError("no server command after --")
    server_dir.mkdir(parents=True, exist_ok=True)
    pid = read_pid(server_dir)
    if pid is not None and group_alive(pid):
        recorded = json.loads((server_dir / "argv.json").read_text())
        if recorded != argv:
            raise AgentError(f"{server_dir} already runs another command (pid {pid})")
        return {"pid": pid, "server_dir": str(server_dir), "already_running": True, "stopped_leftovers": [],
                "other_servers": []}
    stopped, running = sweep_leftovers(server_dir.parent, keep=server_dir)
    if not port_free(port):
        owner = [r for r in running if r["port"] == str(port)]
        who = f" by server {owner[0]['server']} (pid {owner[0]['pid']}) of another run" if owner else ""
        raise AgentError(f"port {port} on 127.0.0.1 is already in use{who}; pick another --port or stop it")
    for name in ("exit", "pid"):
        (server_dir / name).unlink(missing_ok=True)
    (server_dir / "argv.json").write_text(json.dumps(argv))
    write_private(server_dir / ENV_NAME, json.dumps(env))
    (server_dir / "port").write_text(str(port))
    (server_dir / "lease_timeout_s").write_text(str(lease_timeout))
    (server_dir / "lease").touch()
    with open(server_dir / LOG_NAME, "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "infra.node_agent", "supervise", "--server-dir", str(server_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent)
    (server_dir / "pid").write_text(str(supervisor.pid))
    return {"pid": supervisor.pid, "server_dir": str(server_dir), "already_running": False,
            "stopped_leftovers": stopped, "other_servers": running}


def supervise(server_dir: Path) -> int:
    """Run the server as a child (same process group); stop it when the lease goes stale.

    SIGTERM to the group reaches the server too; the supervisor then waits for it and exits
    with it, writing the server's exit code to ``exit``.
    """
    argv = json.loads((server_dir / "argv.json").read_text())
    env = json.loads((server_dir / ENV_NAME).read_text())
    (server_dir / ENV_NAME).unlink()  # read once: no key stays on the node's disk
    timeout = lease_timeout_s(server_dir)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the server got it too; wait for it below
    server = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stdout, stderr=sys.stderr,
                              env={**os.environ, **env})
    (server_dir / "server_pid").write_text(str(server.pid))
    reason = None
    while server.poll() is None:
        time.sleep(SUPERVISE_POLL_S)
        if reason is None and lease_age_s(server_dir) > timeout:
            reason = f"lease not renewed for {lease_age_s(server_dir):.0f}s (timeout {timeout:.0f}s)"
            print(f"node_agent: {reason}: the flow is gone; stopping the server (pid {server.pid})",
                  file=sys.stderr, flush=True)
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    code = server.wait()
    (server_dir / "exit").write_text(str(code))
    print(f"node_agent: server exited with code {code}", file=sys.stderr, flush=True)
    return 0


def stop(server_dir: Path, grace_s: float) -> dict:
    pid = read_pid(server_dir)
    how = "never started" if pid is None else stop_group(pid, grace_s)
    return {**status(server_dir, tail_bytes=0), "stop": how}


# --------------------------------------------------------------------------- checks


def check(engine: str, device: str) -> dict:
    """What the node has; AgentError naming what is missing for ``engine`` on ``device``."""
    facts: dict = {"python": sys.executable, "python_version": platform.python_version(),
                   "home": str(Path.home()), "hostname": socket.gethostname()}
    missing = []
    try:
        import torch
    except ImportError as exc:
        missing.append(f"torch ({exc})")
        torch = None
    if torch is not None:
        facts["torch"] = torch.__version__
        facts["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
            if torch.cuda.is_available() else []
    for module in ("safetensors", "requests"):
        try:
            facts[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            missing.append(module)
    if engine == "transformers":
        try:
            facts["transformers"] = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            missing.append("transformers (the transformers engine runs the model with it)")
    if engine == "sglang":
        from patches.launch import installed_sglang_version
        from patches.sglang_releases import UnsupportedSGLangRelease, release
        facts["sglang"] = installed_sglang_version()
        try:
            release(facts["sglang"])
        except UnsupportedSGLangRelease as exc:
            missing.append(str(exc))
    if (engine == "sglang" or device == "cuda") and torch is not None and not facts["cuda_devices"]:
        missing.append(f"a CUDA GPU (torch {torch.__version__} sees none; --engine {engine} --device {device})")
    if missing:
        raise AgentError(f"python {sys.executable} on {facts['hostname']} lacks: " + "; ".join(missing))
    return facts


def model_facts(model_path: Path) -> dict:
    from dataclasses import asdict

    from tasks.dataset_version import read_model_facts
    if not (model_path / "config.json").is_file():
        raise AgentError(f"model folder {model_path} has no config.json")
    return asdict(read_model_facts(model_path))


def free_port() -> int:
    """A port nothing listens on now, on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_argv: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, server_argv = argv[:split], argv[split + 1:]
    p = argparse.ArgumentParser(prog="python -m infra.node_agent", allow_abbrev=False)
    verbs = p.add_subparsers(dest="verb", required=True)
    c = verbs.add_parser("check")
    c.add_argument("--engine", choices=["transformers", "sglang"], required=True)
    c.add_argument("--device", choices=["cpu", "cuda"], required=True)
    verbs.add_parser("free-port")
    m = verbs.add_parser("model-facts")
    m.add_argument("--model-path", type=Path, required=True)
    s = verbs.add_parser("start")
    s.add_argument("--server-dir", type=Path, required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--lease-timeout-s", type=float, required=True)
    for verb in ("status", "supervise"):
        verbs.add_parser(verb).add_argument("--server-dir", type=Path, required=True)
    st = verbs.add_parser("stop")
    st.add_argument("--server-dir", type=Path, required=True)
    st.add_argument("--grace-s", type=float, default=30.0)
    a = p.parse_args(argv)
    try:
        if a.verb == "supervise":
            return supervise(a.server_dir)
        if a.verb == "check":
            out = check(a.engine, a.device)
        elif a.verb == "free-port":
            out = {"port": free_port()}
        elif a.verb == "model-facts":
            out = model_facts(a.model_path)
        elif a.verb == "start":
            out = start(a.server_dir, a.port, a.lease_timeout_s, server_argv,
                        json.loads(sys.stdin.read() or "{}").get("env", {}))
        elif a.verb == "status":
            out = status(a.server_dir)
        else:
            out = stop(a.server_dir, a.grace_s)
    except AgentError as exc:
        print(f"node_agent {a.verb}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
