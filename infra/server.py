"""Server lifecycle: start a dump-writing model server on a host, wait until healthy, stop it.

``ServerConfig`` is the one description of a server run: the local server takes it as
``python -m infra.local_server`` flags; the SGLang launcher (``patches.launch``) takes the
same flags under SGLang's names. Stopping is idempotent, so a flow can call it from
``finally`` and from its crash/cancellation hooks alike.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from infra.hosts import Host, LocalHost, ServerProcess


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


@dataclass(frozen=True)
class ServerConfig:
    model_path: Path
    dump_dir: Path
    rid_prefix: str
    port: int = 0  # 0: pick a free port on the host
    aux_layer_ids: tuple[int, ...] | None = None  # None: the EAGLE-3 default of the model
    dtype: str = "float32"
    device: str = "cpu"
    chunked_prefill_size: int | None = None
    disable_radix_cache: bool = False
    skip_server_warmup: bool = False
    dump_max_bytes: int | None = None
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()

    def local_server_argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "infra.local_server", "--model-path", str(self.model_path),
                "--host", "127.0.0.1", "--port", str(port), "--dump-dir", str(self.dump_dir),
                "--dump-rid-prefix", self.rid_prefix, "--dtype", self.dtype, "--device", self.device]
        if self.aux_layer_ids is not None:
            argv += ["--dump-aux-layers", *map(str, self.aux_layer_ids)]
        if self.chunked_prefill_size is not None:
            argv += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.disable_radix_cache:
            argv.append("--disable-radix-cache")
        if self.skip_server_warmup:
            argv.append("--skip-server-warmup")
        if self.dump_max_bytes is not None:
            argv += ["--dump-max-bytes", str(self.dump_max_bytes)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv + list(self.extra_args)


@dataclass
class RunningServer:
    host: Host
    config: ServerConfig
    process: ServerProcess
    url: str
    log_path: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def stop(self, grace_s: float = 30.0) -> int | None:
        return self.process.stop(grace_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: ServerConfig, log_path: Path, host: Host | None = None,
                 ready_timeout_s: float = 300.0) -> RunningServer:
    """Start the local server on ``host`` and return once ``/health`` answers 200."""
    host = host or LocalHost()
    port = config.port or free_port()
    process = host.start(config.local_server_argv(port), log_path)
    server = RunningServer(host, config, process, host.url_for_port(port), log_path)
    try:
        wait_healthy(server, ready_timeout_s)
    except BaseException:
        server.stop(grace_s=10)
        raise
    return server


def wait_healthy(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not server.process.alive():
            raise ServerStartError(f"server on {server.host.name} exited during start-up; log {server.log_path}:\n"
                                   f"{server.process.log_tail()}")
        try:
            r = requests.get(f"{server.url}/health", timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise ServerStartError(f"server on {server.host.name} at {server.url} not healthy after {timeout_s:.0f}s "
                           f"(last: {last}); log {server.log_path}:\n{server.process.log_tail()}")
