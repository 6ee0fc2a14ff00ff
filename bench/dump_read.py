"""How fast the extraction core reads, verifies and writes dumps into shards, with no server.

    python -m bench.dump_read [--hidden 4096] [--samples 300] [--in-flight 64] [--reader-processes 0 8]

Dumps of random bf16 states (format 3: token ids, three aux taps, post- and pre-norm final
state) are written into ``--dump-dir`` first, untimed, as a server's writer would (chunked at
``--chunk`` tokens), and the batches' shards are reserved in ``--shards``. Then, per
``--reader-processes`` value, the client consumes them as ``extract_batch`` does, without
the HTTP part: ``--in-flight`` threads each wait for a dump and hand it to the readers,
which verify it and write its rows into its batch's shard. Prints a table: dump GB/s and
prompt tokens/s consumed, and the seconds a sample spends reading and verifying, and writing
(in the reader: time waiting for a free reader is not in them). An H200
prefilling a model of hidden size 4096 makes ~3.3 GB/s of dumps (40,968 B/token at 81k tokens/s).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from patches.capture import PieceRows, capture_pieces
from patches.dumps import DumpReader, DumpSettings, DumpWriter, prompt_hash
from tasks.readers import ReaderPool
from tasks.retrieval import ExpectedDump, StageTimes, into_shard
from tasks.samples import PreparedSample
from tasks.shards import ShardWriter

LAYERS = (2, 8, 13)


def write_dumps(folder: Path, samples: list[PreparedSample], hidden: int, chunk: int) -> None:
    """Each sample's dump, chunked; the states are slices of one random block (their values do not matter)."""
    longest = max(len(s.input_ids) for s in samples)
    block = torch.randn(longest, 5 * hidden).to(torch.bfloat16)
    writer = DumpWriter(DumpSettings(folder, "eagle3-", "bench", LAYERS, max_pending_bytes=8 << 30,
                                     writer_threads=max(1, (os.cpu_count() or 2) // 2)))
    for s in samples:
        ids, n = torch.tensor(s.input_ids), len(s.input_ids)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            rows = block[start:end]
            piece = PieceRows(f"eagle3-{s.sample_key}", start, 0, end - start, n, prompt_hash(s.input_ids))
            while writer.stats()["pending_bytes"] > 2 << 30:  # keep under its budget: it would refuse the piece
                time.sleep(0.01)
            assert capture_pieces(writer, [piece], ids[start:end], list(rows[:, :3 * hidden].split(hidden, -1)),
                                  rows[:, 3 * hidden:4 * hidden], rows[:, 4 * hidden:])
    writer.close(timeout=600)


def consume(args, samples: list[PreparedSample], processes: int) -> dict:
    """Every dump read into its batch's shard; the clock runs from the first read to the last
    write (the shards are reserved before and closed after: per batch, not per sample)."""
    expected = ExpectedDump(LAYERS, args.hidden, "bfloat16", model="bench")
    reader, times = DumpReader(args.dump_dir), StageTimes()
    batches = [samples[i:i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    shards = [ShardWriter(args.shards / f"bench-{processes}-{n:04d}.safetensors", batch, torch.bfloat16, args.hidden,
                          len(LAYERS)) for n, batch in enumerate(batches)]
    readers = ReaderPool(processes) if processes else None
    if readers is not None:
        readers.warm_up()
    with readers or nullcontext():
        reads = [into_shard(expected, reader, shard, readers) for shard in shards]

        def one(index: int) -> None:
            s, rid = samples[index], f"eagle3-{samples[index].sample_key}"
            reads[index // args.batch_size](s, rid, reader.wait(rid, len(s.input_ids), timeout=60), times)

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.in_flight) as pool:
            list(pool.map(one, range(len(samples))))
        wall = time.monotonic() - t0
    for shard in shards:
        Path(shard.close().path).unlink()
    tokens = sum(len(s.input_ids) for s in samples)
    nbytes = tokens * expected.bytes_per_token
    return {"processes": processes, "wall_s": wall, "gb_s": nbytes / wall / 1e9, "tokens_s": tokens / wall,
            "read_s": times.seconds["read and verify"] / len(samples),
            "write_s": times.seconds["shard write"] / len(samples)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--min-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk: a longer prompt's dump has pieces")
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--reader-processes", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--dump-dir", type=Path, default=Path("/dev/shm/eagle3-bench-dumps"))
    ap.add_argument("--shards", type=Path, default=Path("/dev/shm/eagle3-bench-shards"))
    args = ap.parse_args(argv)
    rng = random.Random(0)
    args.shards.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for processes in args.reader_processes:
            lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.samples)]
            samples = [PreparedSample(f"{processes}-{i:06d}", f"s{i}", i + 1, [rng.randrange(16, 1000)] * n, [1] * n,
                                      False) for i, n in enumerate(lengths)]
            write_dumps(args.dump_dir, samples, args.hidden, args.chunk)
            rows.append(consume(args, samples, processes))
    finally:
        shutil.rmtree(args.dump_dir, ignore_errors=True)
    print(f"hidden {args.hidden}, bf16, {args.samples} samples of {args.min_tokens}-{args.max_tokens} tokens, "
          f"chunk {args.chunk}, {args.in_flight} in flight, {os.cpu_count()} cores, shards in {args.shards}")
    print("| reader processes | dumps GB/s | prompt tokens/s | s a sample: read+verify / shard write |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes'] or 'threads'} | {r['gb_s']:.2f} | {r['tokens_s']:,.0f} | "
              f"{r['read_s']:.3f} / {r['write_s']:.3f} |")


if __name__ == "__main__":
    main()
