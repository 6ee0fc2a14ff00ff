"""Whether a server process's busy main thread delays the dump writer: a burst of pieces, timed to the last.

    python -m bench.writer_idle [--hidden 4096] [--pieces 8] [--tokens 1024] [--writer-threads 8]

SGLang 0.5.17's scheduler, once it has no request, loops in Python (pool checks, metrics, a
load snapshot) unless started with ``--sleep-on-idle``, which parks it in ``zmq.Poller.poll``.
The dump writer's threads live in that process and need the GIL after every call that gave it
up; beside a thread running Python, each such call waits up to a switch interval (5 ms) to get
it back. A burst of pieces (a forward's worth, one per writer thread) is queued on a
:class:`patches.dumps.DumpWriter`, their copies "complete" at once, and the main thread either
spins in Python or sleeps in a blocking call until every piece is on disk; the table gives the
seconds. On a 2-core CPU machine (2026-12-07, 8 pieces of 1024 tokens, 8 threads, 5 repeats): with
~30 torch calls and buffered writes per piece, 0.07-0.11 s asleep and 0.13-0.37 s spinning; with
the writer's one ``writev`` and no torch call (commit 555dd9e), 0.07-0.11 s either way.
With 12 threads for 48 pieces the two cores, not the GIL, set the time (1-2 s both ways).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from patches.capture import PieceRows, capture_pieces
from patches.dumps import DumpReader, DumpSettings, DumpWriter, prompt_hash


class Gate:
    """Stands in for the CUDA event a piece's copy records: writers wait on it until the whole burst is queued."""

    def __init__(self):
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.open.wait()


def burst(folder: Path, args, idle: str) -> float:
    """Seconds from having queued ``args.pieces`` pieces to the last one landing, the main thread ``idle``."""
    writer = DumpWriter(DumpSettings(folder, "eagle3-", "bench", (2, 8, 13), max_pending_bytes=64 << 30,
                                     writer_threads=args.writer_threads))
    rows = torch.randn(args.tokens, 5 * args.hidden).to(torch.bfloat16)
    ids = torch.arange(args.tokens)
    reader, rids, gate = DumpReader(folder), [], Gate()
    for n in range(args.pieces):
        rid = f"eagle3-{idle}-{n}"
        piece = PieceRows(rid, 0, 0, args.tokens, args.tokens, prompt_hash(ids.tolist()))
        capture_pieces(writer, [piece], ids, list(rows[:, :3 * args.hidden].split(args.hidden, -1)),
                       rows[:, 3 * args.hidden:4 * args.hidden], rows[:, 4 * args.hidden:],
                       transfer=lambda tensors: (list(tensors), gate))
        rids.append(rid)
    t0 = time.monotonic()  # every piece queued: the copies "complete" now, as at a burst's last forward
    gate.open.set()
    while True:  # the main thread's idle loop, until every piece has landed
        if all(reader.pieces(rid) for rid in rids):
            break
        if idle == "spins":
            until = time.monotonic() + 0.05
            while time.monotonic() < until:
                sum(range(100))  # Python work that holds the GIL, as the scheduler's idle checks do
        else:
            time.sleep(0.05)  # a blocking call that releases the GIL, as zmq.Poller.poll does
    took = time.monotonic() - t0
    writer.close()
    for rid in rids:
        reader.delete(rid)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--writer-threads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dump-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="writer-idle-", dir=args.dump_dir))
    gib = args.pieces * args.tokens * (8 + 5 * args.hidden * 2) / 2**30
    print(f"{args.pieces} pieces of {args.tokens} tokens at hidden {args.hidden} ({gib:.1f} GiB), "
          f"{args.writer_threads} writer threads, switch interval {sys.getswitchinterval() * 1000:.0f} ms, into {folder}")
    print("| main thread | seconds until every piece landed (each repeat) |\n|---|---|")
    try:
        for idle in ("sleeps", "spins"):
            times = [burst(folder, args, idle) for _ in range(args.repeats)]
            print(f"| {idle} | {' / '.join(f'{t:.2f}' for t in times)} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
