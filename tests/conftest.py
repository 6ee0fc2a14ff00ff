"""Shared pytest fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from infra.hosts import free_port
from infra.tiny_model import build_tiny_model
from patches.launch import API_KEY_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny deterministic Llama (8 layers, hidden 64), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (temporary SQLite) for flow tests; its URL is exported for subprocess flows."""
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        url = str(get_current_settings().api.url)
        old = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            if old is None:
                os.environ.pop("PREFECT_API_URL")
            else:
                os.environ["PREFECT_API_URL"] = old


# --------------------------------------------------------------------------- local server


@dataclass
class LocalServerProcess:
    """A ``python -m infra.local_server`` subprocess started by ``start_local_server``."""

    url: str
    dump_dir: Path
    log_path: Path
    process: subprocess.Popen
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def generate(self, timeout: float = 60, **body) -> requests.Response:
        return requests.post(f"{self.url}/generate", json=body, headers=self.headers(), timeout=timeout)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit code (idempotent)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"server {self.url} ignored SIGTERM for {timeout}s; log:\n{self.log_tail()}")
        return self.process.returncode


@pytest.fixture(scope="session")
def start_local_server(tmp_path_factory):
    """A function that starts the local server on a model and waits for ``/health``.

    ``start_local_server(model_dir, *flags, api_key=None)`` returns a
    :class:`LocalServerProcess`; its own ``--dump-dir`` is a fresh tmp folder. Callers
    stop it (``stop()`` returns the exit code); any left running are stopped at the end
    of the session.
    """
    started: list[LocalServerProcess] = []

    def start(model_dir: Path, *flags: str, api_key: str | None = None,
              ready_timeout: float = 120) -> LocalServerProcess:
        work = tmp_path_factory.mktemp("local_server")
        port = free_port()
        argv = [sys.executable, "-m", "infra.local_server", "--model-path", str(model_dir),
                "--port", str(port), "--dump-dir", str(work / "dumps"), *flags]
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else None  # never on the command line
        log_path = work / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        server = LocalServerProcess(f"http://127.0.0.1:{port}", work / "dumps", log_path, process, api_key)
        started.append(server)
        deadline = time.monotonic() + ready_timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f"local server exited with {process.returncode} during start-up:\n"
                                     f"{server.log_tail()}")
            try:
                if requests.get(f"{server.url}/health", timeout=5).status_code == 200:
                    return server
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise AssertionError(f"local server not healthy after {ready_timeout}s:\n{server.log_tail()}")
            time.sleep(0.1)

    yield start
    for server in started:
        server.stop()


# --------------------------------------------------------------------------- an SSH node


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (Debian's openssh-server; .ci/run installs it)."""
    from tests.sshd import SSHD, start_sshd

    if not Path(SSHD).exists():
        pytest.fail(f"{SSHD} is missing: apt-get install -y openssh-server (.ci/run does)")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()
