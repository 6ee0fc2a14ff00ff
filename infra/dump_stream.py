"""The node side of reading dumps over SSH (``--shards-on here``): ``python -m infra.dump_stream``.

    python -m infra.dump_stream --dump-dir DIR --name-prefix PREFIX

Sends every finished dump file (pieces and error markers) whose name starts with PREFIX as
it appears, on stdout, each as one JSON header line ``{"name": ..., "size": ...}`` followed
by the file's bytes; reads acknowledgements (one file name per line) on stdin and deletes a
file on the node only once the flow has acknowledged it. So a connection that drops loses
nothing: the next stream sends again what was not acknowledged (the flow writes files by
name, atomically, so a second copy replaces the first instead of adding a piece). It exits
when stdin closes (the flow went away or the connection dropped).

Files are sent in name order within each listing, which for one rid is chunk order: the
writer renames a rid's pieces into place in order, so when the piece that ends a prompt has
been sent, every earlier piece of that prompt has been too (the reader relies on it).

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Sequence

FILE_SUFFIXES = (".dump.safetensors", ".error.json")  # patches.dumps.PIECE_SUFFIX, ERROR_SUFFIX


def stream(dump_dir: str, name_prefix: str, out, acks) -> None:
    sent: set[str] = set()
    lock = threading.Lock()
    closed = threading.Event()

    def take_acks() -> None:
        for line in acks:
            name = line.decode().rstrip("\n")
            try:
                os.unlink(os.path.join(dump_dir, name))
            except FileNotFoundError:
                pass  # the flow acknowledged a file deleted already
            with lock:  # after the unlink: a listing in between must not send it again
                sent.discard(name)
        closed.set()

    threading.Thread(target=take_acks, name="acks", daemon=True).start()
    poll = 0.0005
    while not closed.is_set():
        try:
            names = sorted(n for n in os.listdir(dump_dir) if n.startswith(name_prefix) and n.endswith(FILE_SUFFIXES))
        except FileNotFoundError:
            names = []
        with lock:
            new = [n for n in names if n not in sent]
            sent.update(new)
        for name in new:
            try:
                with open(os.path.join(dump_dir, name), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue  # the server's writer or an earlier run removed it
            out.write(json.dumps({"name": name, "size": len(data)}).encode() + b"\n")
            out.write(data)
        if new:
            out.flush()
            poll = 0.0005
        else:
            time.sleep(poll)  # look again soon, then back off while the folder is quiet
            poll = min(poll * 2, 0.02)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.dump_stream")
    p.add_argument("--dump-dir", required=True)
    p.add_argument("--name-prefix", required=True)
    a = p.parse_args(argv)
    try:
        stream(a.dump_dir, a.name_prefix, sys.stdout.buffer, sys.stdin.buffer)
    except BrokenPipeError:
        return 0  # the flow went away; unacknowledged files stay for the next stream
    return 0


if __name__ == "__main__":
    sys.exit(main())
