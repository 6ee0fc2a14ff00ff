"""Dump bytes per second over SSH: the project's paths against raw ``ssh host cat``.

    python -m bench.ssh_transfer [--mb 1024] [--file-mb 4] [--rekey-limit 256M]

The "node" is a real OpenSSH server started on loopback (tests/sshd.py; its RekeyLimit
makes it re-key every so many bytes, so the project's paths are measured across re-keys).
The same bytes, as dump-piece files in /dev/shm on the node, are read by:

* raw OpenSSH: ``ssh -p PORT root@127.0.0.1 cat FILES > /dev/null`` (the ceiling);
* ``--shards-on here``'s path: infra.ssh.DumpMirror (stream, write each file here,
  acknowledge, delete on the node), into /dev/shm here;
* the ``--fetch`` path: SshNode.read_file of one file of the same size.

Prints one row per path: MB, seconds, MB/s, % of raw. With ``--flow-prompts FILE`` it also
runs the flow through the same node in both ``--shards-on`` modes (transformers engine, the
tiny model unless ``--model-path``) and prints the extraction rate: tokens/s and the dump
bytes/s the server produced, the rate a ``here`` run must move over SSH.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.ssh import DumpMirror, SshNode, SshSettings
from tests.sshd import start_sshd


def make_pieces(folder: Path, total_mb: int, file_mb: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(file_mb << 20)  # incompressible, like hidden states
    paths = []
    for i in range(max(1, total_mb // file_mb)):
        path = folder / f"eagle3-bench{i:06d}-0123456789ab.000000000.{i:08x}.dump.safetensors"
        path.write_bytes(block)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ssh_transfer")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--file-mb", type=int, default=4)
    p.add_argument("--rekey-limit", default="256M", help="sshd's RekeyLimit (re-keys during the transfer)")
    p.add_argument("--flow-prompts", default=None, help="also time the flow in both --shards-on modes on these")
    p.add_argument("--model-path", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        tmp = Path(tmp)
        sshd = start_sshd(tmp / "sshd", rekey_limit=a.rekey_limit)
        try:
            settings = SshSettings(user=sshd.user, host="127.0.0.1", port=sshd.port, known_hosts=sshd.known_hosts,
                                   key_path=sshd.user_key, python=sys.executable, workdir=str(tmp / "work"))
            rows = []

            pieces = make_pieces(tmp / "node-dumps", a.mb, a.file_mb)
            total = sum(f.stat().st_size for f in pieces)
            ssh = ["ssh", "-i", str(sshd.user_key), "-o", f"UserKnownHostsFile={sshd.known_hosts}",
                   "-o", "StrictHostKeyChecking=yes", "-p", str(sshd.port), f"{sshd.user}@127.0.0.1"]
            t = time.perf_counter()
            subprocess.run(ssh + [shlex.join(["cat", *map(str, pieces)])], stdout=subprocess.DEVNULL, check=True)
            raw_s = time.perf_counter() - t
            rows.append(("raw `ssh host cat` (OpenSSH client)", total, raw_s))

            with SshNode(settings) as node:
                node.prepare()
                local = tmp / "mirror"
                t = time.perf_counter()
                mirror = DumpMirror(node, str(tmp / "node-dumps"), local, "eagle3-")
                while mirror.bytes < total:
                    if mirror.error is not None:
                        raise mirror.error
                    time.sleep(0.005)
                took = time.perf_counter() - t
                mirror.stop()
                rows.append(("DumpMirror (--shards-on here), files written here", mirror.bytes, took))
                for f in local.iterdir():
                    f.unlink()

                big = tmp / "shard.bin"
                with open(big, "wb") as f:
                    for piece in pieces:
                        f.write(piece.read_bytes()) if piece.exists() else f.write(os.urandom(a.file_mb << 20))
                t = time.perf_counter()
                n = node.read_file(str(big), local / "shard.bin")
                rows.append(("SshNode.read_file (--fetch), one file", n, time.perf_counter() - t))
            flows = [run_flow(a, sshd, tmp, mode) for mode in ("node", "here")] if a.flow_prompts else []
        finally:
            sshd.stop()
    raw_rate = total / raw_s
    print("| path | MB | s | MB/s | % of raw |\n|---|---|---|---|---|")
    for name, nbytes, secs in rows:
        rate = nbytes / secs
        print(f"| {name} | {nbytes / 1e6:.0f} | {secs:.2f} | {rate / 1e6:.0f} | {100 * rate / raw_rate:.0f}% |")
    if flows:
        print("\n| --shards-on | samples | tokens/s | dump MB/s produced | extraction s | flow wall s |\n|---|---|---|---|---|---|")
        for mode, summary, extract_s, dump_rate in flows:
            print(f"| {mode} | {summary['written_this_run']} | {summary['tokens_per_s']:.0f} | {dump_rate / 1e6:.1f} "
                  f"| {extract_s:.1f} | {summary['wall_s']:.1f} |")
    return 0


def run_flow(a, sshd, tmp: Path, mode: str) -> tuple[str, dict, float, float]:
    """The flow from a shell through the node; (mode, summary, extraction seconds, dump bytes/s)."""
    model = a.model_path
    if model is None:
        from infra.tiny_model import build_tiny_model
        model = str(build_tiny_model(tmp / "tiny"))
    out = tmp / f"out-{mode}"
    done = subprocess.run([sys.executable, "-m", "flows.extract", "--prompts", a.flow_prompts, "--model-path", model,
                           "--out", str(out), "--node", sshd.url, "--ssh-key", str(sshd.user_key), "--known-hosts",
                           str(sshd.known_hosts), "--node-python", sys.executable, "--node-workdir",
                           str(tmp / f"work-{mode}"), "--shards-on", mode, "--exports"],
                          capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    info = json.loads((Path(summary["version_dir"]) / "dataset.json").read_text())
    width = (len(info["layer_ids"]) + 1) * info["hidden_size"] * {"float32": 4}.get(info["dtype"], 2)
    extract_s = summary["tokens_this_run"] / summary["tokens_per_s"]
    return mode, summary, extract_s, summary["tokens_per_s"] * (width + 8)


if __name__ == "__main__":
    sys.exit(main())
