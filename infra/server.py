"""Server lifecycle: start a dump-writing model server on a host, wait until healthy, stop it.

``ServerConfig`` is the one description of a server run, for either engine: the
transformers engine (``python -m infra.local_server``, the project's own server) or real
SGLang through the launcher (``python -m patches.launch ... -- <sglang flags>``); both take
the same flags under SGLang's names. Paths are paths on the host that runs the server.
Stopping is idempotent, so a flow can call it from ``finally`` and from its
crash/cancellation hooks alike.
"""

from __future__ import annotations

import ipaddress
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

import requests

from infra.hosts import Host, LocalHost, ServerProcess, free_port
from patches.launch import API_KEY_ENV, KEY_FLAGS, flag_values

__all__ = ["ServerConfig", "RunningServer", "ServerStartError", "ForeignServer", "NonLoopbackRefused", "ServerWatch",
           "start_server", "wait_healthy", "free_port", "listen_hosts", "check_server_args"]
Engine = Literal["transformers", "sglang"]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


class ForeignServer(ServerStartError):
    """Something else answers where the server was started: another server on the port."""


class NonLoopbackRefused(ValueError):
    """The server's flags would make it listen beyond loopback, and that was not explicitly allowed."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def listen_hosts(extra_args: Sequence[str]) -> list[str]:
    """The addresses beyond loopback that ``extra_args`` make a server (either engine) listen on;
    ``--config FILE`` (SGLang) counts as one, since the file may set ``host``."""
    hosts = [h for h in flag_values(extra_args, "--host") if not _is_loopback(h)]
    return hosts + [f"whatever --config {c} sets" for c in flag_values(extra_args, "--config")]


def check_server_args(extra_args: Sequence[str], allow_non_loopback: bool) -> None:
    """Refuse the API key on the command line, and listening beyond loopback unless allowed."""
    for flag in KEY_FLAGS:
        if flag_values(extra_args, flag):
            raise ValueError(f"{flag} among the server's flags: a key on a command line is visible to every user "
                             f"of the host (ps); give it as a Prefect Secret block (--api-key-block), a file "
                             f"(--api-key-file) or the {API_KEY_ENV} environment variable")
    hosts = listen_hosts(extra_args)
    if hosts and not allow_non_loopback:
        raise NonLoopbackRefused(f"the server's flags {' '.join(extra_args)!r} make it listen beyond loopback "
                                 f"({', '.join(hosts)}): anyone who reaches the host could use the model and fill "
                                 f"the dump folder; pass --allow-non-loopback to mean it")


def reported_instance(server_info: dict) -> str | None:
    """The dump instance a server reports in ``/server_info``: the transformers engine says it
    directly; SGLang shows the hook's config among its ``forward_hooks``."""
    if "dump_instance" in server_info:
        return server_info["dump_instance"]
    for hook in server_info.get("forward_hooks") or []:
        if isinstance(hook, dict) and hook.get("name") == "eagle3-dump":
            return hook.get("config", {}).get("dump", {}).get("instance")
    return None


@dataclass(frozen=True)
class ServerConfig:
    model_path: Path  # on the server's host
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
    #: the writer's budget of queued bytes (None: the launcher's default)
    dump_max_pending_bytes: int | None = None
    #: reaches the server in its environment (``API_KEY_ENV``), never on its command line
    api_key: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()
    engine: Engine = "transformers"
    #: let ``extra_args`` make the server listen beyond loopback (``--host 0.0.0.0``)
    allow_non_loopback: bool = False
    #: this launch's nonce: the server writes it into every dump piece and reports it in /server_info
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        check_server_args(self.extra_args, self.allow_non_loopback)

    def argv(self, python: str, port: int) -> list[str]:
        """The command that starts this server with ``python`` on ``port`` (loopback, unless
        ``extra_args`` say otherwise and that is allowed). No secret is ever in it."""
        dump = ["--dump-dir", str(self.dump_dir), "--dump-rid-prefix", self.rid_prefix, "--dump-instance", self.instance]
        if self.aux_layer_ids is not None:
            dump += ["--dump-aux-layers", *map(str, self.aux_layer_ids)]
        if self.dump_max_bytes is not None:
            dump += ["--dump-max-bytes", str(self.dump_max_bytes)]
        if self.dump_max_pending_bytes is not None:
            dump += ["--dump-max-pending-bytes", str(self.dump_max_pending_bytes)]
        server = ["--model-path", str(self.model_path), "--host", "127.0.0.1", "--port", str(port),
                  "--dtype", self.dtype, "--device", self.device]
        if self.chunked_prefill_size is not None:
            server += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.disable_radix_cache:
            server.append("--disable-radix-cache")
        if self.skip_server_warmup:
            server.append("--skip-server-warmup")
        server += list(self.extra_args)
        if self.engine == "sglang":
            return [python, "-m", "patches.launch", *dump, "--", *server]
        return [python, "-m", "infra.local_server", *dump, *server]

    def env(self) -> dict[str, str]:
        """The server's environment additions: the API key, which ``ps`` does not show."""
        return {API_KEY_ENV: self.api_key} if self.api_key else {}


@dataclass
class RunningServer:
    host: Host
    config: ServerConfig
    process: ServerProcess
    url: str  # as reached from here (through a tunnel for a node)
    port: int  # on the host's loopback
    log_path: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def stop(self, grace_s: float = 30.0) -> int | None:
        return self.process.stop(grace_s)


def start_server(config: ServerConfig, log_path: Path, host: Host | None = None,
                 ready_timeout_s: float = 300.0) -> RunningServer:
    """Start the server on ``host`` (default: this machine) and return once ``/health`` answers 200."""
    host = host or LocalHost()
    port = config.port or host.free_port()
    process = host.start(config.argv(host.python, port), log_path, port, env=config.env())
    server = RunningServer(host, config, process, host.url_for_port(port), port, log_path)
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
                check_identity(server)
                return
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise ServerStartError(f"server on {server.host.name} at {server.url} not healthy after {timeout_s:.0f}s "
                           f"(last: {last}); log {server.log_path}:\n{server.process.log_tail()}")


def check_identity(server: RunningServer) -> None:
    """The server that answers is the one just started: ``/health`` only proves that something answers."""
    r = requests.get(f"{server.url}/server_info", headers=server.headers(), timeout=10)
    info = r.json() if r.status_code == 200 else {}
    got = reported_instance(info)
    if got != server.config.instance:
        raise ForeignServer(f"another server answers at {server.url} (port {server.port} on {server.host.name}): it "
                            f"reports dump instance {got!r}, the one started here is {server.config.instance!r} "
                            f"(HTTP {r.status_code} from /server_info). Is port {server.port} in use? Our server's "
                            f"log {server.log_path}:\n{server.process.log_tail()}")


class ServerWatch:
    """Watches a running server while batches use it; calls ``on_gone(reason)`` once when it is gone.

    Gone: the process exited, or the server is hung: alive but ``/health`` went unanswered
    (timeout, refused connection, an error status) ``misses`` times in a row, each probe
    waiting ``health_timeout_s``. A hung server is killed, so that the requests it holds
    fail at once instead of waiting out their own (long) timeouts; the caller restarts it.
    A request timeout cannot tell a hung server from a long prefill; a health check can
    (the transformers engine and SGLang answer it while busy).
    """

    def __init__(self, server: RunningServer, on_gone: Callable[[str], None], health_timeout_s: float = 30.0,
                 misses: int = 2, interval_s: float = 1.0):
        self.server, self.on_gone = server, on_gone
        self.health_timeout_s, self.misses, self.interval_s = health_timeout_s, misses, interval_s
        #: why the server is gone, once it is
        self.gone: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-watch", daemon=True)

    def __enter__(self) -> "ServerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(self.interval_s)  # a probe in flight ends on its own (daemon thread) and reports nothing

    def _run(self) -> None:
        where = f"the server on {self.server.host.name} port {self.server.port} (log {self.server.log_path})"
        missed: list[str] = []
        while not self._done.wait(self.interval_s):
            if not self.server.process.alive():
                return self._report(f"{where} exited")
            problem = self._probe()
            missed = missed + [problem] if problem else []
            if self._done.is_set():
                return
            if len(missed) >= self.misses and self.server.process.alive():
                self._report(f"{where} is hung: /health failed {len(missed)} times in a row ({'; '.join(missed)}); "
                             f"killed it")
                self.server.stop(grace_s=2.0)  # a hung process may not act on SIGTERM (SIGSTOP defers it)
                return

    def _probe(self) -> str | None:
        try:
            r = requests.get(f"{self.server.url}/health", headers=self.server.headers(), timeout=self.health_timeout_s)
        except requests.RequestException as exc:
            return f"{type(exc).__name__} after {self.health_timeout_s:g}s" if isinstance(
                exc, requests.Timeout) else type(exc).__name__
        return None if r.status_code == 200 else f"HTTP {r.status_code}"

    def _report(self, reason: str) -> None:
        self.gone = reason
        self.on_gone(reason)
