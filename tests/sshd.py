"""A real OpenSSH server on a loopback port, with generated host and user keys: the tests' GPU node."""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    process: subprocess.Popen
    folder: Path
    user_key: Path
    known_hosts: Path
    host_key_fingerprint: str
    log: Path

    @property
    def user(self) -> str:
        return getpass.getuser()

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}"

    def session_pids(self) -> list[int]:
        """The per-connection sshd processes (the listener's children): killing one cuts that connection."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rfind(")") + 2:].split()[1]) == self.process.pid:
                    pids.append(int(entry))
        return pids

    def cut_connections(self) -> int:
        pids = self.session_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)


def start_sshd(folder: Path, rekey_limit: str | None = None) -> Sshd:
    folder.mkdir(parents=True, exist_ok=True)
    host_key, user_key = folder / "host_ed25519", folder / "user_ed25519"
    keygen(host_key)
    keygen(user_key)
    (folder / "authorized_keys").write_text((folder / "user_ed25519.pub").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = folder / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {folder / 'sshd.pid'}",
        f"AuthorizedKeysFile {folder / 'authorized_keys'}", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no",
        "AllowTcpForwarding local", "ClientAliveInterval 5", *([f"RekeyLimit {rekey_limit}"] if rekey_limit else []),
    ]) + "\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation folder sshd insists on
    log = folder / "sshd.log"
    process = subprocess.Popen([SSHD, "-D", "-f", str(config), "-E", str(log)])
    pub = (folder / "host_ed25519.pub").read_text().split()
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
    fp = subprocess.run(["ssh-keygen", "-lf", str(folder / "host_ed25519.pub")], capture_output=True, text=True,
                        check=True).stdout.split()[1]
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"sshd did not start: {log.read_text() if log.exists() else ''}")
            time.sleep(0.05)
    return Sshd(port, process, folder, user_key, folder / "known_hosts", fp, log)
