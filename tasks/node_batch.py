"""A batch extracted on the GPU node itself (``--shards-on node``): ``python -m tasks.node_batch VERB``.

    extract   stdin: one JSON job (see :func:`job_json`); stdout: the shard's summary and the failures
    index     --version-dir D: the shard index rows of every finished shard there (for resume)

``extract`` runs the extraction core (tasks.retrieval) against the server on the node's
loopback, reads dumps from the node's own folder and writes the shard next to them; only
the shard's summary and the failures go back over SSH.

It is idempotent per shard path, so the flow can run it again after a dropped connection
without losing or duplicating a sample: a lock file serialises two runs of one batch (an
orphan of the dropped connection may still be working), and the result is kept in
``batches/<shard>.json`` beside ``shards/``; a later run of the batch returns that result
instead of extracting again.

torch, safetensors and requests only (tests/test_node_imports.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from patches.dumps import DumpReader
from tasks.readers import ReaderPool, reader_process_count
from tasks.retrieval import ExpectedDump, InFlightLimit, RetrievalSettings, SampleFailure, StageTimes, extract_batch
from tasks.samples import PreparedSample
from tasks.shards import list_shards, read_shard_index


def job_json(settings: RetrievalSettings, dump_dir: str, shard_path: str, max_in_flight: int,
             samples: Sequence[PreparedSample], max_dump_bytes_in_flight: int = 2 << 30,
             store_dtype: str | None = None, reader_processes: int | None = 0) -> dict:
    """The job ``extract`` reads: everything it needs, as JSON (paths are the node's)."""
    return {"settings": {**asdict(settings), "headers": [list(h) for h in settings.headers]},
            "dump_dir": dump_dir, "shard_path": shard_path, "max_in_flight": max_in_flight,
            "max_dump_bytes_in_flight": max_dump_bytes_in_flight, "store_dtype": store_dtype,
            "reader_processes": reader_processes,
            "samples": [asdict(s) for s in samples]}


def result_path(shard_path: Path) -> Path:
    return shard_path.parent.parent / "batches" / (shard_path.name + ".json")


def extract_job(job: dict) -> dict:
    s = job["settings"]
    expected = ExpectedDump(**{**s["expected"], "layer_ids": tuple(s["expected"]["layer_ids"])})
    settings = RetrievalSettings(**{**s, "expected": expected, "headers": tuple(tuple(h) for h in s["headers"])})
    samples = [PreparedSample(**d) for d in job["samples"]]
    shard_path = Path(job["shard_path"])
    done = result_path(shard_path)
    done.parent.mkdir(parents=True, exist_ok=True)
    shard_path.parent.mkdir(parents=True, exist_ok=True)
    with open(done.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an earlier run of this batch (connection dropped) finishes first
        if done.exists():
            return {**json.loads(done.read_text()), "reused": True}
        limit, times = InFlightLimit(job["max_in_flight"], job["max_dump_bytes_in_flight"]), StageTimes()
        processes = reader_process_count(job["reader_processes"])
        with ReaderPool(processes) if processes else nullcontext() as readers:
            shard, failed = extract_batch(settings, DumpReader(job["dump_dir"], settings.expected.instance), samples,
                                          limit, shard_path, job["store_dtype"], times=times, readers=readers)
        result = {"shard": asdict(shard) if shard else None, "failures": [asdict(f) for f in failed],
                  "stage_s": times.seconds}
        tmp = done.with_name(f".{done.name}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, done)
    return {**result, "reused": False}


def failures_from_json(result: dict) -> list[SampleFailure]:
    return [SampleFailure(**f) for f in result["failures"]]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["extract"]:
        out = extract_job(json.loads(sys.stdin.read()))
    elif argv[:2] == ["index", "--version-dir"] and len(argv) == 3:
        out = {"index": [row for shard in list_shards(Path(argv[2])) for row in read_shard_index(shard)]}
    else:
        print("usage: python -m tasks.node_batch extract < JOB | index --version-dir DIR", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
