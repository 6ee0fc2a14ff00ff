"""Where a model server runs: ``LocalHost`` (this machine) or ``infra.ssh.SshHost`` (a node over SSH).

A host names a free loopback port, starts a long-running command with its output going to a
log file, tells whether it is still alive, stops it (SIGTERM to its process group, then
SIGKILL after a grace period), reads the tail of its log, and gives the URL under which its
loopback port is reached from here.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from infra.node_agent import free_port, port_free  # stdlib only: the node runs the same checks



def _die_with_parent() -> None:
    """``preexec_fn``: Linux sends this child SIGTERM when the thread that started it ends, so a
    flow killed with SIGKILL takes its children along (the local server also watches its parent;
    SGLang's launcher and Prefect's API server do not). Runs between fork and exec: only a
    libc call."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def dependent_child() -> dict:
    """Popen arguments for a child that lives in its own session (a terminal's Ctrl-C reaches the
    flow, which stops it in order, not the child) and dies with the flow."""
    return {"start_new_session": True, "preexec_fn": _die_with_parent}


class HostError(RuntimeError):
    """A command could not be started or stopped on a host."""


class ServerProcess(Protocol):
    def alive(self) -> bool: ...
    def stop(self, grace_s: float = 30.0) -> int | None: ...
    def log_tail(self, max_bytes: int = 4000) -> str: ...


class Host(Protocol):
    name: str
    python: str  # the interpreter that runs servers there

    def free_port(self) -> int: ...
    def start(self, argv: Sequence[str], log_path: Path, port: int,
              env: dict[str, str] | None = None) -> ServerProcess: ...
    def url_for_port(self, port: int) -> str: ...


@dataclass
class LocalProcess:
    popen: subprocess.Popen
    log_path: Path
    command: str  # for messages (never holds a secret: keys travel in the environment)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group, wait, then SIGKILL. Safe to call twice."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # already gone
        pass


@dataclass
class LocalHost:
    """This machine. The server's loopback port is reached directly."""

    name: str = "localhost"
    python: str = sys.executable

    def free_port(self) -> int:
        return free_port()

    def start(self, argv: Sequence[str], log_path: Path, port: int,
              env: dict[str, str] | None = None) -> LocalProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = shlex.join(argv)
        if not port_free(port):
            raise HostError(f"{self.name}: port {port} on 127.0.0.1 is already in use; cannot start `{command}`")
        with open(log_path, "ab") as log:
            try:
                # A new session: stop() signals the server and any children it spawned.
                popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, **dependent_child())
            except OSError as exc:
                raise HostError(f"{self.name}: cannot start `{command}`: {exc}") from exc
        return LocalProcess(popen, log_path, command)

    def url_for_port(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

