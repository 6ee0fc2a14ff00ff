"""A GPU node reached over SSH: verified host keys, quoted commands, the project's code uploaded,
servers started and stopped through ``infra.node_agent``, a lease, a tunnel, files streamed home.

One :class:`SshNode` is one node and one SSH connection (paramiko), shared by every server,
batch and tunnel on that node; a run with several nodes holds several. The connection is
re-opened when it drops (a killed sshd session, a network blip); commands that are safe to
run twice (all of the agent's verbs, ``tasks.node_batch``, reads) are then run again.

Every command is an argv list joined with ``shlex.join``: no value from the configuration
or the prompts is ever interpreted by the node's shell.

paramiko re-keys after 512 MiB in either direction and was measured to time out doing so
under sustained transfers (shared/notes/ssh.md, paramiko#822). The client never initiates a
re-key here (its packetizer limits are raised); OpenSSH re-keys from its side, which paramiko
answers correctly (tests/test_ssh_node.py moves GBs through a server with a small RekeyLimit).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import shlex
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

import paramiko

from infra.hosts import HostError

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
#: the packages whose code runs on the node (the server, the hook, the agent, the extraction core)
NODE_PACKAGES = ("patches", "infra", "tasks")
_NO_CLIENT_REKEY = 1 << 62


class _QuietRefusedChannels(logging.Filter):
    """paramiko logs an ERROR for each forwarded connection the node refuses: while a server
    starts, that is every health check through the tunnel. The tunnel reports refusals itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Secsh channel") and "open FAILED" in message)


logging.getLogger("paramiko.transport").addFilter(_QuietRefusedChannels())


# --------------------------------------------------------------------------- errors


class SshError(HostError):
    """The node could not be reached or refused us; the message names the node."""


class HostKeyUnknown(SshError):
    """The node's host key is not in the known_hosts file."""


class HostKeyChanged(SshError):
    """The node offered a key other than the one known_hosts holds for it."""


class SshAuthFailed(SshError):
    """The node refused the user key."""


class SshConnectionLost(SshError):
    """The connection dropped while a command ran."""


class NodeCommandFailed(SshError):
    """A command on the node exited non-zero; the message holds the command and its stderr."""

    def __init__(self, node: str, command: str, code: int, stderr: str):
        self.node, self.command, self.code, self.stderr = node, command, code, stderr
        super().__init__(f"{node}: `{command}` exited {code}: {stderr.strip()[-3000:]}")


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SshSettings:
    """How to reach one node and where the project lives on it."""

    user: str
    host: str
    port: int = 22
    known_hosts: Path = Path("~/.ssh/known_hosts")
    key_path: Path | None = None
    key_text: str | None = field(default=None, repr=False)  # a private key's text (from a Prefect Block)
    python: str = "python3"
    workdir: str = "eagle3-extract"  # relative: under the user's home on the node
    dump_dir: str | None = None  # None: {workdir}/dumps
    keepalive_s: float = 10.0
    connect_timeout_s: float = 20.0
    #: how long a dropped connection is retried before the command fails
    reconnect_for_s: float = 120.0
    #: exec channels open at once on the connection; OpenSSH refuses more than its MaxSessions (10)
    max_sessions: int = 8

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@{self.host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH and paramiko name the host in known_hosts."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


def parse_node_url(url: str) -> tuple[str, str, int]:
    """``ssh://USER@HOST[:PORT]`` -> (user, host, port)."""
    parts = urlsplit(url)
    if parts.scheme != "ssh" or not parts.username or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"node {url!r}: expected ssh://USER@HOST[:PORT]")
    try:
        port = parts.port or 22
    except ValueError as exc:
        raise ValueError(f"node {url!r}: bad port: {exc}") from None
    return parts.username, parts.hostname, port


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint (what ``ssh-keygen -lf`` prints)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _Transport(paramiko.Transport):
    """paramiko's transport with AES-GCM preferred (no separate MAC: ~1.5x the stream rate of its
    default aes128-ctr + hmac-sha2-256 here) and no re-key started from this side (module doc)."""

    _preferred_ciphers = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com",
                          *(c for c in paramiko.Transport._preferred_ciphers if "gcm" not in c))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packetizer.REKEY_BYTES = self.packetizer.REKEY_PACKETS = _NO_CLIENT_REKEY


class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    def __init__(self, settings: SshSettings):
        self.settings = settings

    def missing_host_key(self, client, hostname, key):
        s = self.settings
        raise HostKeyUnknown(
            f"{s.url}: host key {key.get_name()} {fingerprint(key)} is not in {s.known_hosts}; refused. "
            f"If that is the node's key (compare with `ssh-keygen -lf /etc/ssh/ssh_host_{_key_file(key)}_key.pub` "
            f"run on the node), accept it deliberately: `ssh-keyscan -p {s.port} {s.host} >> {s.known_hosts}`")


def _key_file(key: paramiko.PKey) -> str:
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(key.get_name(), "ecdsa")


def _load_user_key(settings: SshSettings) -> paramiko.PKey:
    errors = []
    for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            if settings.key_text is not None:
                return cls.from_private_key(io.StringIO(settings.key_text))
            return cls.from_private_key_file(str(Path(settings.key_path).expanduser()))
        except (paramiko.SSHException, ValueError) as exc:
            errors.append(f"{cls.__name__}: {exc}")
        except OSError as exc:
            raise SshAuthFailed(f"{settings.url}: cannot read the SSH key {settings.key_path}: {exc}") from exc
    where = "the key text of the node block" if settings.key_text is not None else str(settings.key_path)
    raise SshAuthFailed(f"{settings.url}: {where} is no unencrypted ed25519, ECDSA or RSA private key "
                        f"({'; '.join(errors)})")


# --------------------------------------------------------------------------- the node


@dataclass(frozen=True)
class CommandResult:
    code: int
    stdout: bytes
    stderr: str


class SshNode:
    """One node over one (re-opened when dropped) SSH connection. Thread-safe."""

    def __init__(self, settings: SshSettings):
        if settings.key_path is None and settings.key_text is None:
            raise SshAuthFailed(f"{settings.url}: no SSH key given (--ssh-key, or the node block's key)")
        self.settings = settings
        self.name = settings.url
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self.reconnects = 0
        self.home: str | None = None
        self.code_dir: str | None = None
        self._leases: set[str] = set()
        self._lease_timer: threading.Event | None = None
        self.sessions = threading.BoundedSemaphore(settings.max_sessions)

    # -- connection

    def transport(self) -> paramiko.Transport:
        """The live transport, connecting (host key verified) if there is none."""
        with self._lock:
            t = self._client.get_transport() if self._client else None
            if t is not None and t.is_active():
                return t
            if self._client is not None:
                self._client.close()
                self.reconnects += 1
                log.warning("%s: connection lost; reconnecting (reconnect %d)", self.name, self.reconnects)
            self._client = self._connect()
            return self._client.get_transport()

    def _connect(self) -> paramiko.SSHClient:
        s = self.settings
        known = Path(s.known_hosts).expanduser()
        client = paramiko.SSHClient()
        try:
            client.load_host_keys(str(known))
        except FileNotFoundError:
            raise HostKeyUnknown(f"{s.url}: known_hosts file {known} does not exist; refused (never auto-accepted). "
                                 f"Create it deliberately: `ssh-keyscan -p {s.port} {s.host} >> {known}` after "
                                 "checking the fingerprint on the node") from None
        client.set_missing_host_key_policy(_RefuseUnknownHost(s))
        pkey = _load_user_key(s)
        try:
            client.connect(s.host, port=s.port, username=s.user, pkey=pkey, allow_agent=False, look_for_keys=False,
                           timeout=s.connect_timeout_s, banner_timeout=s.connect_timeout_s,
                           auth_timeout=s.connect_timeout_s, transport_factory=_Transport)
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyChanged(
                f"{s.url}: host key CHANGED: the node offered {exc.key.get_name()} {fingerprint(exc.key)}, "
                f"{known} holds {exc.expected_key.get_name()} {fingerprint(exc.expected_key)} for "
                f"{s.known_hosts_name}; refused. If the node was reinstalled and you checked the new fingerprint on "
                f"it, replace the entry deliberately: `ssh-keygen -R '{s.known_hosts_name}' -f {known}` then "
                f"`ssh-keyscan -p {s.port} {s.host} >> {known}`") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise SshAuthFailed(f"{s.url}: user {s.user!r} was refused with key {fingerprint(pkey)} "
                                f"({s.key_path or 'from the node block'}): {exc}. Is its public key in "
                                f"~{s.user}/.ssh/authorized_keys on the node?") from None
        except HostKeyUnknown:
            client.close()
            raise
        except (paramiko.SSHException, OSError) as exc:
            client.close()
            raise SshConnectionLost(f"{s.url}: cannot connect: {type(exc).__name__}: {exc}") from exc
        t = client.get_transport()
        t.set_keepalive(max(1, int(s.keepalive_s)))
        return client

    def close(self) -> None:
        self.stop_leases()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> "SshNode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands

    def command_line(self, argv: Sequence[str], cwd: str | None = None) -> str:
        """The shell line that runs ``argv`` (in ``cwd``). It never holds a secret (the node's shell and
        ``ps`` show it): secrets go on stdin (the server's API key: :meth:`SshHost.start`)."""
        line = shlex.join([str(a) for a in argv])
        return f"cd {shlex.quote(cwd)} && exec {line}" if cwd else line

    def run(self, argv: Sequence[str], stdin: bytes = b"", cwd: str | None = None, check: bool = True,
            retry: bool = True, timeout_s: float | None = None) -> CommandResult:
        """Run ``argv`` on the node; re-run it after a dropped connection when ``retry``
        (only for commands that are safe to run twice)."""
        line = self.command_line(argv, cwd)
        deadline = None  # from the first loss: a command may run for hours before one
        delay = 0.5
        while True:
            try:
                result = self._exec(line, stdin, timeout_s)
                break
            except SshConnectionLost as exc:
                deadline = deadline or time.monotonic() + self.settings.reconnect_for_s
                if not retry or time.monotonic() > deadline:
                    raise
                log.warning("%s: %s; running `%s` again", self.name, exc, line[:200])
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        if check and result.code != 0:
            raise NodeCommandFailed(self.name, line, result.code, result.stderr)
        return result

    def open_session(self) -> paramiko.Channel:
        """An exec channel (hold ``sessions`` while it is open); a dead transport is dropped and
        reported as a lost connection, a channel the node refuses is not."""
        try:
            return self.transport().open_session(timeout=self.settings.connect_timeout_s)
        except paramiko.ChannelException as exc:
            raise SshError(f"{self.name}: the node refused a channel ({exc}); is its sshd MaxSessions below "
                           f"max_sessions={self.settings.max_sessions}?") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise SshConnectionLost(f"{self.name}: cannot open a channel: {type(exc).__name__}: {exc}") from exc

    def _exec(self, line: str, stdin: bytes, timeout_s: float | None) -> CommandResult:
        """Run one shell line."""
        with self.sessions:
            return self._exec_in_session(line, stdin, timeout_s)

    def _exec_in_session(self, line: str, stdin: bytes, timeout_s: float | None) -> CommandResult:
        chan = self.open_session()
        err: list[bytes] = []
        try:
            chan.settimeout(timeout_s)
            chan.exec_command(line)
            reader = threading.Thread(target=lambda: err.append(_read_all(chan.recv_stderr)), daemon=True)
            reader.start()
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out = _read_all(chan.recv)
            reader.join()
            code = chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise SshConnectionLost(f"{self.name}: connection lost during `{line[:200]}`: "
                                    f"{type(exc).__name__}: {exc}") from exc
        finally:
            chan.close()
        if code == -1 or not chan.exit_status_ready():
            self._drop()
            raise SshConnectionLost(f"{self.name}: connection lost during `{line[:200]}` (no exit status)")
        return CommandResult(code, out, b"".join(err).decode("utf-8", "replace"))

    def _drop(self) -> None:
        """Forget a transport that failed, so the next command reconnects."""
        with self._lock:
            t = self._client.get_transport() if self._client else None
            if t is not None and t.is_active():
                t.close()

    # -- the project on the node

    def resolve(self, path: str) -> str:
        """A node path; relative ones are under the user's home (known once ``prepare`` ran)."""
        if path.startswith("/"):
            return path
        if self.home is None:
            raise SshError(f"{self.name}: home folder not known yet (call prepare first)")
        return f"{self.home}/{path}"

    def prepare(self) -> str:
        """Learn the home folder (with the node's Python: it must run) and upload the code once."""
        if self.code_dir is None:
            probe = self.run([self.settings.python, "-c", "import pathlib; print(pathlib.Path.home())"])
            self.home = probe.stdout.decode().strip()
            self.upload_code()
        return self.code_dir

    def check(self, engine: str, device: str) -> dict:
        """Python, torch, the SGLang release and the GPU (node_agent check); the node's facts."""
        self.prepare()
        return self.agent(["check", "--engine", engine, "--device", device])

    @property
    def dump_dir(self) -> str:
        return self.resolve(self.settings.dump_dir or f"{self.settings.workdir}/dumps")

    def version_dir(self, fingerprint: str) -> str:
        """Where a dataset version's shards live on the node (``--shards-on node``)."""
        return self.resolve(f"{self.settings.workdir}/versions/{fingerprint}")

    def upload_code(self) -> str:
        """Copy the node-side packages to ``{workdir}/code/{content hash}`` once; return that folder."""
        files = sorted(p for pkg in NODE_PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)
        digest = hashlib.sha256()
        for p in files:
            digest.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
        target = self.resolve(f"{self.settings.workdir}/code/{digest.hexdigest()[:16]}")
        if self.run(["test", "-f", f"{target}/.complete"], check=False).code != 0:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                for p in files:
                    tar.add(p, arcname=str(p.relative_to(REPO)))
            tmp = f"{target}.tmp-{time.time_ns()}"
            steps = [["mkdir", "-p", tmp], ["tar", "-xzf", "-", "-C", tmp], ["touch", f"{tmp}/.complete"],
                     ["mv", "-T", tmp, target]]
            line = " && ".join(shlex.join(s) for s in steps)
            result = self._exec(line, buf.getvalue(), 120)
            if result.code != 0 and self.run(["test", "-f", f"{target}/.complete"], check=False).code != 0:
                raise NodeCommandFailed(self.name, line, result.code, result.stderr)
            self.run(["rm", "-rf", tmp], check=False)
        self.code_dir = target
        return target

    def python_module(self, module: str, args: Sequence[str], stdin: bytes = b"", retry: bool = True) -> dict:
        """``python -m module args`` in the uploaded code; its JSON answer."""
        if self.code_dir is None:
            raise SshError(f"{self.name}: code not uploaded yet (call prepare first)")
        result = self.run([self.settings.python, "-m", module, *args], stdin=stdin, cwd=self.code_dir, retry=retry)
        try:
            return json.loads(result.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise NodeCommandFailed(self.name, f"python -m {module} {shlex.join(args)}", result.code,
                                    f"no JSON answer ({exc}): {result.stdout[-500:]!r} {result.stderr}") from exc

    def agent(self, args: Sequence[str], stdin: bytes = b"") -> dict:
        return self.python_module("infra.node_agent", args, stdin=stdin)

    # -- leases

    def keep_lease(self, server_dir: str, timeout_s: float) -> None:
        """Renew ``server_dir``'s lease every ``timeout_s / 4`` until :meth:`release_lease`."""
        with self._lock:
            self._leases.add(server_dir)
            if self._lease_timer is None:
                self._lease_timer = threading.Event()
                threading.Thread(target=self._renew_loop, args=(self._lease_timer, timeout_s / 4),
                                 name=f"lease-{self.settings.host}", daemon=True).start()

    def release_lease(self, server_dir: str) -> None:
        with self._lock:
            self._leases.discard(server_dir)

    def stop_leases(self) -> None:
        with self._lock:
            if self._lease_timer is not None:
                self._lease_timer.set()
                self._lease_timer = None

    def _renew_loop(self, stopped: threading.Event, every_s: float) -> None:
        while not stopped.wait(every_s):
            with self._lock:
                dirs = sorted(self._leases)
            if not dirs:
                continue
            try:  # touch, not a Python start: cheap enough for short leases; -c: a stopped server's folder stays bare
                self.run(["touch", "-c", *(f"{d}/lease" for d in dirs)])
            except SshError as exc:  # the next renewal tries again; a server whose lease runs out stops
                log.error("%s: lease renewal of %s failed: %s", self.name, dirs, exc)

    # -- files

    def read_file(self, remote: str, local: Path, chunk: int = 1 << 20) -> int:
        """Stream a node file into ``local`` (atomically); a dropped connection resumes where it was."""
        size = int(self.run(["stat", "-c", "%s", remote]).stdout)
        tmp = local.with_name(f".{local.name}.part")
        local.parent.mkdir(parents=True, exist_ok=True)
        deadline, progress = None, -1
        with open(tmp, "wb") as f:
            while f.tell() < size:
                try:
                    self._stream(["tail", "-c", f"+{f.tell() + 1}", remote], f, chunk)
                except SshConnectionLost as exc:
                    if f.tell() != progress:  # bytes came since the last loss: a new loss, a new window
                        deadline, progress = time.monotonic() + self.settings.reconnect_for_s, f.tell()
                    if time.monotonic() > deadline:
                        raise
                    log.warning("%s: %s; resuming %s at byte %d", self.name, exc, remote, f.tell())
                    time.sleep(0.5)
                    continue
                if f.tell() != size:
                    raise SshError(f"{self.name}: {remote} is {f.tell()} bytes here, {size} on the node")
        tmp.replace(local)
        return size

    def _stream(self, argv: Sequence[str], sink, chunk: int) -> None:
        with self.sessions:
            self._stream_in_session(self.command_line(argv), sink, chunk)

    def _stream_in_session(self, line: str, sink, chunk: int) -> None:
        chan = self.open_session()
        try:
            chan.exec_command(line)
            chan.shutdown_write()
            while data := chan.recv(chunk):
                sink.write(data)
            code = chan.recv_exit_status()
            err = chan.recv_stderr(4000).decode("utf-8", "replace") if chan.recv_stderr_ready() else ""
            chan.close()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._drop()
            raise SshConnectionLost(f"{self.name}: connection lost during `{line}`: {type(exc).__name__}: {exc}") from exc
        if code == -1:
            self._drop()
            raise SshConnectionLost(f"{self.name}: connection lost during `{line}` (no exit status)")
        if code != 0:
            raise NodeCommandFailed(self.name, line, code, err)

    # -- tunnels

    def forward(self, remote_port: int) -> "Tunnel":
        return Tunnel(self, remote_port)


def _read_all(recv: Callable[[int], bytes]) -> bytes:
    parts = []
    while data := recv(1 << 16):
        parts.append(data)
    return b"".join(parts)


class Tunnel:
    """A local loopback port whose connections go to ``127.0.0.1:remote_port`` on the node
    (paramiko ``direct-tcpip`` channels; a new connection after a drop uses the new transport)."""

    def __init__(self, node: SshNode, remote_port: int):
        self.node, self.remote_port = node, remote_port
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.local_port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name=f"tunnel-{remote_port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            chan = self.node.transport().open_channel("direct-tcpip", ("127.0.0.1", self.remote_port), peer,
                                                      timeout=self.node.settings.connect_timeout_s)
        except paramiko.ChannelException as exc:  # refused: the server is not up (yet); its health check says so
            log.debug("%s: tunnel to port %d: %s", self.node.name, self.remote_port, exc)
            conn.close()
            return
        except (SshError, paramiko.SSHException, EOFError, OSError) as exc:
            log.warning("%s: tunnel to port %d: %s", self.node.name, self.remote_port, exc)
            conn.close()
            return

        def pump(src_recv, dst_send, done):
            try:
                while data := src_recv(1 << 16):
                    dst_send(data)
            except (OSError, EOFError, paramiko.SSHException):
                pass  # either side closed: the other is closed below
            finally:
                done()

        def close_both():
            chan.close()
            try:  # shutdown, not just close: it wakes the other pump's recv and tells the client
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already shut down by the other pump
            conn.close()

        t = threading.Thread(target=pump, args=(chan.recv, conn.sendall, close_both), daemon=True)
        t.start()
        pump(conn.recv, chan.sendall, close_both)
        t.join()

    def close(self) -> None:
        self._closed = True
        try:  # shutdown wakes the accept() of the listening thread; close alone would not
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected state on some kernels: close() below still releases the port
        self._listener.close()


# --------------------------------------------------------------------------- servers on the node


@dataclass
class NodeServerProcess:
    """A server started by ``node_agent start``; its log is copied to ``log_path`` when it stops."""

    node: SshNode
    server_dir: str
    log_path: Path
    command: str  # for messages (never holds a secret)

    def alive(self) -> bool:
        return bool(self.node.agent(["status", "--server-dir", self.server_dir])["alive"])

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``grace_s``; idempotent."""
        answer = self.node.agent(["stop", "--server-dir", self.server_dir, "--grace-s", str(grace_s)])
        self.node.release_lease(self.server_dir)
        self.node.read_file(f"{self.server_dir}/server.log", self.log_path)
        return None if answer["exit"] is None else int(answer["exit"])

    def log_tail(self, max_bytes: int = 4000) -> str:
        return self.node.agent(["status", "--server-dir", self.server_dir])["log_tail"][-max_bytes:]


@dataclass
class SshHost:
    """A node as a :class:`infra.hosts.Host`: servers start detached under a lease the flow keeps
    renewing, and are reached through a tunnel. Any number of servers may share one node."""

    node: SshNode
    lease_timeout_s: float = 60.0
    tunnels: list[Tunnel] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def python(self) -> str:
        return self.node.settings.python

    def free_port(self) -> int:
        return int(self.node.agent(["free-port"])["port"])

    def start(self, argv: Sequence[str], log_path: Path, port: int,
              env: dict[str, str] | None = None) -> NodeServerProcess:
        """Start ``argv`` on the node; its folder is ``servers/<log file stem>`` (unique per server).
        ``env`` (the API key) goes to the agent on stdin, never on the remote command line."""
        argv = [str(a) for a in argv]
        server_dir = self.node.resolve(f"{self.node.settings.workdir}/servers/{log_path.stem}")
        answer = self.node.agent(["start", "--server-dir", server_dir, "--port", str(port),
                                  "--lease-timeout-s", str(self.lease_timeout_s), "--", *argv],
                                 stdin=json.dumps({"env": env or {}}).encode())
        for line in answer["stopped_leftovers"]:
            log.warning("%s: stopped a server left by an earlier run whose lease ran out: %s", self.name, line)
        for other in answer["other_servers"]:
            log.info("%s: another run's server is running there: %s", self.name, other)
        self.node.keep_lease(server_dir, self.lease_timeout_s)
        return NodeServerProcess(self.node, server_dir, log_path, shlex.join(argv))

    def url_for_port(self, port: int) -> str:
        tunnel = self.node.forward(port)
        self.tunnels.append(tunnel)
        return tunnel.url

    def close(self) -> None:
        for tunnel in self.tunnels:
            tunnel.close()
        self.tunnels.clear()


# --------------------------------------------------------------------------- dumps read over the connection


class _AckSender:
    """Acknowledges received files in batches: one tiny packet per file halved the stream rate."""

    every_s = 0.02

    def __init__(self, chan: paramiko.Channel):
        self.chan, self.names, self.lock, self.done = chan, [], threading.Lock(), threading.Event()
        threading.Thread(target=self._run, name="dump-acks", daemon=True).start()

    def add(self, name: str) -> None:
        with self.lock:
            self.names.append(name)

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            with self.lock:
                names, self.names = self.names, []
            if names:
                try:
                    self.chan.sendall("".join(n + "\n" for n in names).encode())
                except (paramiko.SSHException, EOFError, OSError):
                    return  # the stream is gone; the node sends the unacknowledged files again

    def stop(self) -> None:
        self.done.set()


class DumpMirror:
    """Keeps a local folder filled with the dump files of a node folder (``--shards-on here``).

    ``infra.dump_stream`` on the node sends each finished file once; the mirror writes it here
    atomically under its own name and acknowledges it, and only then is it deleted on the node.
    A dropped connection restarts the stream, which sends again what was not acknowledged: no
    file is lost, and a second copy replaces the first (same name). The local
    :class:`patches.dumps.DumpReader` then reads the mirror as if the server were here.
    """

    def __init__(self, node: SshNode, remote_dir: str, local_dir: Path, name_prefix: str):
        self.node, self.remote_dir, self.local_dir, self.name_prefix = node, remote_dir, Path(local_dir), name_prefix
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.bytes = 0
        self.files = 0
        self.restarts = 0
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._chan: paramiko.Channel | None = None
        self._thread = threading.Thread(target=self._run, name=f"dump-mirror-{node.settings.host}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = None
        while not self._stopped.is_set():
            try:
                self._stream_once()
                deadline = None
            except SshConnectionLost as exc:
                if self._stopped.is_set():
                    return
                deadline = deadline or time.monotonic() + self.node.settings.reconnect_for_s
                if time.monotonic() > deadline:
                    self.error = exc
                    log.error("%s: dump stream lost for good: %s", self.node.name, exc)
                    return
                self.restarts += 1
                log.warning("%s: dump stream interrupted (%s); restarting it", self.node.name, exc)
                time.sleep(0.5)
            except BaseException as exc:  # kept and re-raised by stop(): the run must not go on blind
                self.error = exc
                log.error("%s: dump stream failed: %s", self.node.name, exc)
                return

    def _stream_once(self) -> None:
        with self.node.sessions:
            self._stream_in_session()

    def _stream_in_session(self) -> None:
        argv = [self.node.settings.python, "-m", "infra.dump_stream", "--dump-dir", self.remote_dir,
                "--name-prefix", self.name_prefix]
        line = self.node.command_line(argv, cwd=self.node.code_dir)
        acks = None
        try:
            chan = self.node.open_session()
            chan.exec_command(line)
            self._chan = chan
            acks = _AckSender(chan)
            buf = bytearray()  # parsed in place: paramiko's file objects copy per packet (4x slower here)
            while True:
                while (eol := buf.find(b"\n")) < 0 and (data := chan.recv(1 << 20)):
                    buf += data
                if eol < 0:
                    break  # the stream ended
                meta = json.loads(buf[:eol])
                del buf[:eol + 1]
                size = meta["size"]
                while len(buf) < size and (data := chan.recv(1 << 20)):
                    buf += data
                if len(buf) < size:
                    break  # cut mid-file: the node sends it again
                name = Path(meta["name"]).name  # a name, never a path
                tmp = self.local_dir / f".{name}.{time.time_ns()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(memoryview(buf)[:size])
                del buf[:size]
                tmp.replace(self.local_dir / name)
                acks.add(name)
                self.bytes += size
                self.files += 1
            code = chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if self._stopped.is_set():
                return
            self.node._drop()
            raise SshConnectionLost(f"{self.node.name}: dump stream: {type(exc).__name__}: {exc}") from exc
        finally:
            self._chan = None
            if acks is not None:
                acks.stop()
        if self._stopped.is_set():
            return
        if code != 0:
            err = chan.recv_stderr(4000).decode("utf-8", "replace") if chan.recv_stderr_ready() else ""
            if code == -1:
                self.node._drop()
                raise SshConnectionLost(f"{self.node.name}: dump stream ended without an exit status")
            raise NodeCommandFailed(self.node.name, line, code, err)
        raise SshConnectionLost(f"{self.node.name}: dump stream ended")

    def stop(self) -> None:
        """End the stream; re-raise what broke it, if anything did."""
        time.sleep(2 * _AckSender.every_s)  # the last acknowledgements go out first
        self._stopped.set()
        chan = self._chan
        if chan is not None:
            chan.shutdown_write()  # the node side exits on stdin's end
            chan.close()
        self._thread.join(30)
        if self.error is not None:
            raise self.error
