"""Reader processes: dumps read, verified and written into shards outside the requesting process.

Threads of one process reading GB/s of dumps wait on its one interpreter lock and on its one
address space's lock (every page mapped or freed): on the H200, 64 such threads took 0.57 s
a sample to read and verify what one thread alone reads in 0.03 s. Processes share neither.

A reader is ``python -m tasks.readers``: it reads pickled :class:`tasks.retrieval.DumpJob`
from its stdin, runs :func:`tasks.retrieval.read_dump` and answers on its stdout; a dump
never travels between processes (the reader writes the rows into the shard's file itself).
Not ``multiprocessing``: its pools import the caller's main module again in every worker (a
flow started from a script without a main guard fails, a flow module costs seconds a
worker), and its workers outlived a SIGKILLed flow. These end with the flow: their stdin
closes (only the flow holds it open), and they finish the job in hand first. No parent-death
signal: Linux sends it when the *thread* that started the process ends, and a reader that
replaces a dead one is started by whichever extraction thread found it dead, which ends
with its batch.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

import torch

from tasks.retrieval import DumpJob, ReaderDied, read_dump

_LENGTH = struct.Struct("<Q")


def _send(stream: BinaryIO, value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> bytes:
    """One message's pickled bytes (unpickled by the caller: a message that does not unpickle
    leaves the stream in step)."""
    head = stream.read(_LENGTH.size)
    if len(head) != _LENGTH.size:
        raise EOFError("the stream ended")
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"the stream ended {size - len(data)} bytes into a message")
    return data


def reader_process_count(wanted: int | None) -> int:
    """Reader processes for a run: ``wanted``, or half this machine's cores when None (0: none,
    the request threads read)."""
    return max(1, (os.cpu_count() or 2) // 2) if wanted is None else wanted


class ReaderPool:
    """``processes`` readers for every batch of a run; ``run`` is called from many threads, each
    job goes to an idle reader. A reader that dies (killed for memory...) fails its job as a
    retryable :class:`tasks.retrieval.ReaderDied` and is replaced."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"a reader pool needs at least one process, not {processes}")
        self.processes = processes
        self._idle: queue.SimpleQueue[subprocess.Popen] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._readers: list[subprocess.Popen] = []
        for _ in range(processes):
            self._idle.put(self._start())

    def _start(self) -> subprocess.Popen:
        # its own session: a terminal's Ctrl-C reaches the flow, which lets the reader finish its job
        reader = subprocess.Popen([sys.executable, "-m", "tasks.readers"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, start_new_session=True)
        with self._lock:
            self._readers.append(reader)
        return reader

    def warm_up(self) -> None:
        """Wait until every reader has started (imports done), e.g. before a clock runs."""
        readers = [self._idle.get() for _ in range(self.processes)]
        for reader in readers:
            _send(reader.stdin, None)
        for reader in readers:
            _receive(reader.stdout)
            self._idle.put(reader)

    def run(self, job: DumpJob) -> tuple[str | None, float, float]:
        """:func:`tasks.retrieval.read_dump` of the job in a reader; its errors are raised here."""
        reader = self._idle.get()
        try:
            _send(reader.stdin, job)
            answer = _receive(reader.stdout)
        except (OSError, EOFError) as exc:
            code = reader.wait()
            with self._lock:
                self._readers.remove(reader)
            self._idle.put(self._start())
            raise ReaderDied(job.sample.sample_key, job.sample.source_id,
                             f"reader process {reader.pid} ended (exit code {code}) while reading rid {job.rid} "
                             f"from {job.reader.dump_dir}") from exc
        self._idle.put(reader)
        ok, value = pickle.loads(answer)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End every reader (each finishes its job first: its stdin closes)."""
        with self._lock:
            readers, self._readers = self._readers, []
        for reader in readers:
            reader.stdin.close()
        for reader in readers:
            try:
                reader.wait(timeout=30)
            except subprocess.TimeoutExpired:
                reader.kill()
                reader.wait()
            reader.stdout.close()

    def __enter__(self) -> "ReaderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve() -> None:
    """A reader's loop: a job in, its result (or its exception) out, until stdin ends."""
    jobs, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the answer stream
    torch.set_num_threads(1)  # the pool is the parallelism: N readers of N cores each would oversubscribe
    while True:
        try:
            job = pickle.loads(_receive(jobs))
        except EOFError:
            return
        if job is None:  # warm_up's ping
            _send(answers, (True, None))
            continue
        try:
            answer = (True, read_dump(job))
        except Exception as exc:  # raised again in the pool's caller, which decides about retries
            answer = (False, exc)
        try:
            _send(answers, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle
            _send(answers, (False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))


if __name__ == "__main__":
    serve()
