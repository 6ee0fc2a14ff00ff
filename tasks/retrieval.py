"""Content-matched retrieval: send a sample, find ITS dump by rid, verify it by content.

The extraction core runs without Prefect: :func:`extract_batch` takes prepared samples
and a server, writes the verified ones into a shard as they arrive and returns the
shard's summary and the failures. Threads of this process send the requests and wait for
the dumps; a :class:`tasks.readers.ReaderPool`'s processes read, verify and write them (a dump never
travels between processes: a reader writes its rows into the shard's file itself, and
only their digest comes back). Each attempt uses a
fresh rid (sample key + attempt + nonce) and a unique ``extra_key`` so that neither the
prefix cache nor an earlier attempt's leftovers can stand in for this request. A dump
is accepted only if its pieces cover every prompt token exactly once with the
request's own token ids, the configured layers, shapes and finite values.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import requests
import torch

from patches.dumps import DumpError, DumpReader, PieceInfo, ReadBuffer
from tasks.samples import PreparedSample, TrainingSample
from tasks.shards import HIDDEN_DTYPES, ShardSlot, ShardSummary, ShardWriter

if TYPE_CHECKING:
    from tasks.readers import ReaderPool

log = logging.getLogger(__name__)


class SampleError(Exception):
    """One sample could not be extracted. ``retryable`` says whether another attempt can help."""

    retryable = True
    #: the attempt (1-based, counted over the batch's and the sample task's tries) that raised it
    attempt: int | None = None

    def __init__(self, sample_key: str, source_id: str, reason: str):
        self.sample_key, self.source_id, self.reason = sample_key, source_id, reason
        super().__init__(f"sample {source_id!r} (key {sample_key[:12]}): {reason}")

    def __reduce__(self):  # raised in a reader process, re-raised in this one
        return type(self), (self.sample_key, self.source_id, self.reason), {"attempt": self.attempt}


class ServerRejected(SampleError):
    """The server refused the request as bad input (HTTP 400): retrying cannot fix it."""

    retryable = False


class ServerUnavailable(SampleError):
    """The server did not answer, or answered with an error it may recover from."""


class DumpUnusable(SampleError):
    """The request's dump was missing, incomplete, corrupt or foreign."""


class ConfigMismatch(SampleError):
    """The dump was written with other layers, dtype or model than this run expects."""

    retryable = False


class ServerGone(Exception):
    """The run's server died or was stopped: nothing more is sent to it (``InFlightLimit.stop``)."""


class PermanentFailure(SampleError):
    """A failure already known not to be retryable, re-raised where it is reported."""

    retryable = False


class ReaderDied(SampleError):
    """The reader process reading the sample's dump died (killed for memory...); it was replaced."""


@dataclass(frozen=True)
class ExpectedDump:
    """What every dump of this run must carry (checked on each sample)."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    #: the model path the server was started with (None: not checked)
    model: str | None = None
    #: the launch nonce of the server this run started: any other server's pieces are foreign
    instance: str | None = None

    @property
    def bytes_per_token(self) -> int:
        """Dump bytes per prompt token: the id, the aux taps and the final state."""
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 8 + (len(self.layer_ids) + 1) * self.hidden_size * itemsize


class InFlightLimit:
    """Requests, and dump bytes, in flight at most: one per server, shared by every batch using it.

    A request's place is the server's: it is freed (:meth:`Place.answered`) when the server
    answers, so the server has ``max_requests`` prompts to batch while earlier dumps are
    still being read. A request's dump occupies the server's writer queue (pinned
    host memory) and the dump folder from its prefill until this client has read and
    deleted it, so its bytes stay held until then. That keeps the writer under its budget
    when the host cannot keep up: the server gets fewer requests (it slows down) instead
    of refusing pieces it already computed. A sample larger than the whole byte budget goes alone.

    Places are granted in order of ``priority`` (then arrival): with the batch index as
    priority, batches finish one after another, so one batch writes its shard while the
    next keeps the server busy, instead of all finishing, and writing, at once. A place that
    frees wakes only the waiters it admits: waking every waiter to find the next in line
    (hundreds of threads with several batches) cost ~20 ms an admission on the H200, which
    capped a run at ~50 samples a second.
    """

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self._requests = self._bytes = 0
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, int, _Ticket]] = []  # (priority, arrival, ticket), a heap
        self._arrivals = itertools.count()
        #: why the server is gone (set by ``stop``); nothing more is sent once it is
        self.stopped: str | None = None

    def stop(self, reason: str) -> None:
        """The server is gone: waiting and later samples fail at once instead of trying it."""
        with self._lock:
            self.stopped = reason
            for _, _, ticket in self._waiting:
                ticket.event.set()
            self._waiting.clear()

    def _admit(self) -> None:
        """Grant places to the head of the queue while they fit (under the lock)."""
        while self._waiting and self.stopped is None:
            ticket = self._waiting[0][2]
            if self._requests >= self.max_requests or self._bytes + ticket.nbytes > self.max_bytes:
                return
            heapq.heappop(self._waiting)
            self._requests += 1
            self._bytes += ticket.nbytes
            ticket.granted = True
            ticket.event.set()

    def _release(self, requests: int, nbytes: int) -> None:
        with self._lock:
            self._requests -= requests
            self._bytes -= nbytes
            self._admit()

    @contextmanager
    def hold(self, nbytes: int, priority: int = 0) -> Iterator[Place]:
        """A request's place and ``nbytes`` of dump; the place until :meth:`Place.answered`
        (or the end), the bytes until the end."""
        ticket = _Ticket(min(nbytes, self.max_bytes))
        with self._lock:
            if self.stopped is None:
                heapq.heappush(self._waiting, (priority, next(self._arrivals), ticket))
                self._admit()
            else:
                ticket.event.set()
        ticket.event.wait()
        if self.stopped is not None:  # stop() woke it, or came right after its place was granted
            if ticket.granted:
                self._release(1, ticket.nbytes)
            raise ServerGone(self.stopped)
        place = Place(self)
        try:
            yield place
        finally:
            self._release(0 if place.freed else 1, ticket.nbytes)


class Place:
    """A granted request place of an :class:`InFlightLimit` (see :meth:`InFlightLimit.hold`)."""

    def __init__(self, limit: InFlightLimit):
        self._limit, self.freed = limit, False

    def answered(self) -> None:
        """The server answered: its place goes to the next request; the dump's bytes stay held."""
        if not self.freed:
            self.freed = True
            self._limit._release(1, 0)


class _Ticket:
    """A sample's turn in an :class:`InFlightLimit`: its event is set once it is granted a place
    (``granted``) or the server is gone."""

    __slots__ = ("nbytes", "granted", "event")

    def __init__(self, nbytes: int):
        self.nbytes, self.granted, self.event = nbytes, False, threading.Event()


class StageTimes:
    """Seconds the samples spent in each stage of an attempt, summed over samples (threads overlap:
    the sum exceeds the wall time; the shares say where the time goes), and when batches finished
    (``finished``: seconds since this object was made, samples done by then). Thread-safe."""

    STAGES = ("server", "dump wait", "reader wait", "read and verify", "shard write")

    def __init__(self):
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.finished: list[tuple[float, int]] = []

    def batch_finished(self, samples: int) -> None:
        with self._lock:
            done = (self.finished[-1][1] if self.finished else 0) + samples
            self.finished.append((time.monotonic() - self._started, done))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] += time.perf_counter() - start

    def add(self, seconds: dict[str, float]) -> None:
        with self._lock:
            for name, value in seconds.items():
                self.seconds[name] += value


@dataclass(frozen=True)
class RetrievalSettings:
    url: str
    rid_prefix: str
    expected: ExpectedDump
    headers: tuple[tuple[str, str], ...] = ()
    attempts: int = 3
    backoff_s: float = 0.5
    dump_wait_s: float = 60.0
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class SampleFailure:
    sample_key: str
    source_id: str
    reason: str
    error: str  # exception class name
    retryable: bool
    attempts: int


def new_rid(prefix: str, sample_key: str, attempt: int) -> str:
    return f"{prefix}{sample_key[:16]}-a{attempt}-{uuid.uuid4().hex[:12]}"


def send_generate(settings: RetrievalSettings, sample: PreparedSample, rid: str,
                  session: requests.Session) -> dict:
    """POST one prefill-only request; return its ``meta_info``."""
    body = {"input_ids": list(sample.input_ids), "rid": rid, "extra_key": rid,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    try:
        r = session.post(f"{settings.url}/generate", json=body, headers=dict(settings.headers),
                         timeout=settings.request_timeout_s)
    except requests.RequestException as exc:
        raise ServerUnavailable(sample.sample_key, sample.source_id,
                                f"POST {settings.url}/generate rid {rid}: {type(exc).__name__}: {exc}") from exc
    if r.status_code == 400:
        raise ServerRejected(sample.sample_key, sample.source_id, f"server refused rid {rid}: {r.text[:500]}")
    if r.status_code != 200:
        raise ServerUnavailable(sample.sample_key, sample.source_id,
                                f"POST /generate rid {rid}: HTTP {r.status_code} {r.text[:300]}")
    meta = r.json().get("meta_info", {})
    if meta.get("id", rid) != rid:
        raise ServerUnavailable(sample.sample_key, sample.source_id, f"answer for rid {meta.get('id')!r}, sent {rid!r}")
    return meta


def verified_sample(expected: ExpectedDump, reader: DumpReader, sample: PreparedSample, rid: str,
                    infos: list[PieceInfo], buffer: ReadBuffer | None = None) -> TrainingSample:
    """The rid's pieces assembled and verified, as the sample's training tensors (views into
    ``buffer`` when given)."""
    try:
        dump = reader.assemble(rid, sample.input_ids, infos, buffer)
    except DumpError as exc:
        raise DumpUnusable(sample.sample_key, sample.source_id, f"{type(exc).__name__}: {exc}") from exc
    got = (tuple(dump.layer_ids), dump.final_hidden_states.shape[1], dump.dtype, dump.model)
    want = (expected.layer_ids, expected.hidden_size, expected.dtype,
            dump.model if expected.model is None else expected.model)
    if got != want:
        raise ConfigMismatch(sample.sample_key, sample.source_id,
                             f"dump of rid {rid} has layers/hidden/dtype/model {got}, this run expects {want}")
    return TrainingSample(sample_key=sample.sample_key, source_id=sample.source_id,
                          input_ids=dump.input_ids, loss_mask=torch.tensor(sample.loss_mask, dtype=torch.int64),
                          aux_hidden_states=dump.aux_hidden_states, final_hidden_states=dump.final_hidden_states,
                          prenorm_hidden_states=dump.prenorm_hidden_states)


@dataclass(frozen=True)
class DumpJob:
    """One attempt's dump, for a reader: where it is, what it must be, where its rows go."""

    reader: DumpReader
    expected: ExpectedDump
    rid: str
    sample: PreparedSample
    infos: tuple[PieceInfo, ...]
    #: the sample's place in its shard; None: read and verified only (the load benchmark)
    slot: ShardSlot | None


_thread_buffer = threading.local()


def read_dump(job: DumpJob) -> tuple[str | None, float, float]:
    """Assemble and verify the dump, write its rows into the slot: (content hash, seconds reading
    and verifying, seconds writing). Runs in a reader process (:mod:`tasks.readers`) or the
    calling thread, with that thread's :class:`ReadBuffer`."""
    if not hasattr(_thread_buffer, "buffer"):
        _thread_buffer.buffer = ReadBuffer()
    start = time.perf_counter()
    extracted = verified_sample(job.expected, job.reader, job.sample, job.rid, list(job.infos),
                                _thread_buffer.buffer)
    read = time.perf_counter()
    digest = job.slot.write(extracted) if job.slot is not None else None
    return digest, read - start, time.perf_counter() - read


#: what an attempt does with its dump once every piece is there: (sample, rid, pieces, times)
Consume = Callable[[PreparedSample, str, list[PieceInfo], StageTimes], None]


def keep_samples(expected: ExpectedDump, reader: DumpReader, write: Callable[[TrainingSample], None]) -> Consume:
    """Each verified sample, in fresh memory, to ``write`` in the calling thread (checks and
    benchmarks that look at the tensors themselves)."""
    def consume(sample: PreparedSample, rid: str, infos: list[PieceInfo], times: StageTimes) -> None:
        with times.stage("read and verify"):
            extracted = verified_sample(expected, reader, sample, rid, infos)
        with times.stage("shard write"):
            write(extracted)
    return consume


def into_shard(expected: ExpectedDump, reader: DumpReader, shard: ShardWriter | None,
               readers: ReaderPool | None) -> Consume:
    """Each dump read, verified and written into ``shard`` by ``readers`` (None: the calling
    thread); without a shard, read and verified only."""
    run = readers.run if readers is not None else read_dump

    def consume(sample: PreparedSample, rid: str, infos: list[PieceInfo], times: StageTimes) -> None:
        slot = shard.claim(sample.sample_key) if shard is not None else None
        job = DumpJob(reader, expected, rid, sample, tuple(infos), slot)
        start = time.perf_counter()
        try:
            digest, read_s, write_s = run(job)
        except BaseException:
            if shard is not None:
                shard.release(sample.sample_key)
            raise
        if shard is not None:
            shard.filled(sample.sample_key, digest)
        # the rest of the call: waiting for a free reader, and the pipe
        waited = time.perf_counter() - start - read_s - write_s
        times.add({"reader wait": max(0.0, waited), "read and verify": read_s, "shard write": write_s})
    return consume


def attempt_dump(settings: RetrievalSettings, reader: DumpReader, sample: PreparedSample, attempt: int,
                 session: requests.Session, times: StageTimes, consume: Callable[[str, list[PieceInfo]], object],
                 answered: Callable[[], None] | None = None):
    """One attempt: fresh rid, request, ``answered()`` once the server has answered, wait for
    that rid's pieces, ``consume(rid, pieces)`` (which matches them with the sample's ids);
    returns what it returns.

    The rid's files are deleted however the attempt ends, pieces of a failed request included.
    """
    rid = new_rid(settings.rid_prefix, sample.sample_key, attempt)
    try:
        with times.stage("server"):
            meta = send_generate(settings, sample, rid, session)
        if answered is not None:
            answered()
        if meta.get("prompt_tokens", len(sample.input_ids)) != len(sample.input_ids):
            raise DumpUnusable(sample.sample_key, sample.source_id,
                               f"server counted {meta.get('prompt_tokens')} prompt tokens, sent {len(sample.input_ids)}")
        try:
            with times.stage("dump wait"):
                infos = reader.wait(rid, len(sample.input_ids), timeout=settings.dump_wait_s)
        except DumpError as exc:
            raise DumpUnusable(sample.sample_key, sample.source_id, f"{type(exc).__name__}: {exc}") from exc
        return consume(rid, infos)
    except SampleError as exc:
        exc.attempt = attempt
        raise
    finally:
        reader.delete(rid)


def extract_one(settings: RetrievalSettings, reader: DumpReader, sample: PreparedSample, attempt: int,
                session: requests.Session, times: StageTimes | None = None) -> TrainingSample:
    """One attempt (:func:`attempt_dump`), its sample verified in this thread, in fresh memory."""
    times = times or StageTimes()

    def verify(rid: str, infos: list[PieceInfo]) -> TrainingSample:
        with times.stage("read and verify"):
            return verified_sample(settings.expected, reader, sample, rid, infos)
    return attempt_dump(settings, reader, sample, attempt, session, times, verify)


def extract_with_retries(settings: RetrievalSettings, reader: DumpReader, sample: PreparedSample,
                         session: requests.Session, limit: InFlightLimit, consume: Consume,
                         priority: int = 0, times: StageTimes | None = None) -> SampleFailure | None:
    """Up to ``settings.attempts`` attempts with exponential backoff; permanent errors stop at once.
    The dump goes to ``consume`` (:func:`into_shard`, :func:`keep_samples`); None means it did.

    Each attempt holds its place in ``limit`` until the server answers, and its dump's bytes
    until its sample is written (so the bytes a slow reader holds count too); the backoff
    between attempts holds neither.
    """
    nbytes = len(sample.input_ids) * settings.expected.bytes_per_token
    times = times or StageTimes()
    last: SampleError | None = None
    for i in range(settings.attempts):
        try:
            with limit.hold(nbytes, priority) as place:
                attempt_dump(settings, reader, sample, i + 1, session, times,
                             lambda rid, infos: consume(sample, rid, infos, times), place.answered)
                return None
        except ServerGone as gone:
            return SampleFailure(sample.sample_key, sample.source_id, f"not sent: {gone}", "ServerUnavailable",
                                 True, i)
        except SampleError as exc:
            last = exc
            # every failed attempt is visible, also the ones a later attempt makes good
            log.warning("attempt %d of %d: %s: %s", i + 1, settings.attempts, type(exc).__name__, exc,
                        extra={"sample_error": type(exc).__name__})
            if not exc.retryable or limit.stopped is not None:
                break
            if i + 1 < settings.attempts:
                time.sleep(settings.backoff_s * (2 ** i))
    assert last is not None
    return SampleFailure(sample.sample_key, sample.source_id, last.reason, type(last).__name__,
                         last.retryable, last.attempt)


def threads_for(limit: InFlightLimit) -> int:
    """Threads to keep ``limit``'s places full: a sample's thread stays with it while its dump is
    read, after the server has answered and its place has gone to the next request."""
    return 2 * limit.max_requests


def extract_samples(settings: RetrievalSettings, reader: DumpReader, samples: Sequence[PreparedSample],
                    limit: InFlightLimit, consume: Consume,
                    on_done: Callable[[], None] | None = None, priority: int = 0,
                    times: StageTimes | None = None) -> list[SampleFailure]:
    """Extract a batch under ``limit`` (which other batches to the same server may share;
    lower ``priority`` goes first). Each dump goes to ``consume`` as soon as it is there (from
    several threads), so no batch is held in memory. Returns the failures, in input order."""
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=limit.max_requests)
    session.mount("http://", adapter)

    def run(sample: PreparedSample) -> SampleFailure | None:
        result = extract_with_retries(settings, reader, sample, session, limit, consume, priority, times)
        if on_done is not None:
            on_done()
        return result

    with session, ThreadPoolExecutor(max_workers=threads_for(limit), thread_name_prefix="extract") as pool:
        return [failure for failure in pool.map(run, samples) if failure is not None]


def extract_batch(settings: RetrievalSettings, reader: DumpReader, samples: Sequence[PreparedSample],
                  limit: InFlightLimit, shard_path, store_dtype: str | None = None,
                  on_done: Callable[[], None] | None = None, priority: int = 0, times: StageTimes | None = None,
                  readers: ReaderPool | None = None) -> tuple[ShardSummary | None, list[SampleFailure]]:
    """A batch extracted straight into its shard (:class:`tasks.shards.ShardWriter`) by ``readers``
    (None: this process's threads): the shard's summary (None when every sample failed) and the
    failures. A shard that cannot be written (a full disk) raises, naming it, and leaves nothing behind."""
    exp = settings.expected
    with ShardWriter(shard_path, samples, HIDDEN_DTYPES[exp.dtype], exp.hidden_size, len(exp.layer_ids),
                     store_dtype) as shard:
        failed = extract_samples(settings, reader, samples, limit, into_shard(exp, reader, shard, readers),
                                 on_done, priority, times)
        return shard.close(), failed
