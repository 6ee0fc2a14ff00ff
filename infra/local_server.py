"""The transformers engine: an SGLang-compatible HTTP server that runs a Hugging Face model and writes dumps.

    [EAGLE3_API_KEY=KEY] python -m infra.local_server --model-path DIR --port N --dump-dir DIR [options]

With ``EAGLE3_API_KEY`` set, every route but ``/health*`` needs ``Authorization: Bearer KEY``
(SGLang's ``--api-key``, taken from the environment so that ``ps`` does not show it).

It behaves like an SGLang server with the dump patch in the ways that break naive
"one request, one dump" assumptions, so the pipeline can be tested on a laptop:

* one scheduler thread, continuous batching: each step takes prefill chunks under a
  per-step token budget (``--chunked-prefill-size``, summed over the step's requests,
  -1 disables chunking) and, with ``--enable-mixed-chunk``, decoding requests ride
  along as one-row extends; otherwise a step is either all prefill or all decode;
* a prefix ("radix") cache, on by default, namespaced by ``extra_key``: a request
  reuses the longest cached prefix of a finished sequence, at most ``T-1`` tokens;
* a warmup request at start-up and real 1-token forwards for ``/health``;
* KV carries over between chunks (a transformers ``DynamicCache`` per request).

Each step's outputs are laid out as one flat batch (rows in request order) and cut
per request by :func:`patches.batch_slicing.slice_extend_batch`, the slicing the
SGLang patch uses. Pieces go to :class:`patches.dumps.DumpWriter`, a background
thread, so a forward never waits on the disk. ``--dump-every-forward`` is the
"careless hook": it writes a piece for every forward of every request (warmup,
health checks, decode steps as ``forward_mode="decode"``), ignoring the rid prefix.

Decoding is greedy whatever ``sampling_params`` say; it stops at ``max_new_tokens``
or at an end-of-sequence token (unless ``ignore_eos``). SIGTERM stops accepting
requests, lets running ones finish (refusing what is left after a grace period),
drains the dump writer and exits 0. It does the same when the process that started it
dies (it is reparented), so a killed flow does not leave an orphan server holding a port.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import torch

from patches.batch_slicing import slice_extend_batch
from patches.capture import PieceRows, capture_pieces
from patches.dumps import RID_PREFIX, DumpSettings, DumpWriter, default_aux_layer_ids, prompt_hash
from patches.launch import API_KEY_ENV

log = logging.getLogger("infra.local_server")

WARMUP_TEXT = "The capital city of France is"  # SGLang's warmup request
WARMUP_MAX_NEW_TOKENS = 8
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
HEALTH_TIMEOUT_S = 20.0
#: tokens of finished sequences whose KV the prefix cache keeps (LRU beyond that).
PREFIX_CACHE_MAX_TOKENS = 32768


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and this message."""


class Refused(RuntimeError):
    """The server cannot take or finish the request now (shutting down): HTTP 503."""


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.local_server", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], default=None,
                   help="default: float32 on CPU, auto on CUDA (SGLang's rule: float16 for float32/16 "
                        "models, bfloat16 for bfloat16 models)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="prefill tokens per scheduler step, summed over its requests; -1 disables chunking")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="decoding requests join prefill steps as one-row extends")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take before they are refused")
    p.add_argument("--dump-dir", required=True, type=Path)
    p.add_argument("--dump-rid-prefix", default=RID_PREFIX)
    p.add_argument("--dump-aux-layers", type=int, nargs="+", default=None,
                   help="HF hidden_states indices; default: patches.dumps.default_aux_layer_ids")
    p.add_argument("--dump-max-bytes", type=int, default=None, help="cap on the dump folder's size")
    p.add_argument("--dump-max-pending-bytes", type=int, default=DumpSettings.max_pending_bytes,
                   help="host memory the writer queue may hold; over it a piece is refused (error marker)")
    p.add_argument("--dump-instance", default=None,
                   help="this launch's nonce, written into every dump piece and reported by /server_info "
                        "(default: a fresh random one)")
    p.add_argument("--dump-every-forward", action="store_true",
                   help="the careless hook: a piece for every forward of every request, decode steps included")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    # The key comes in the environment: on the command line every user of the host would see it (ps).
    args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        p.error(f"--chunked-prefill-size must be -1 (off) or positive, not {args.chunked_prefill_size}")
    if args.max_running_requests < 1:
        p.error(f"--max-running-requests must be positive, not {args.max_running_requests}")
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "auto"
    return args


def resolve_dtype(name: str, config_dtype: torch.dtype | str | None) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    config_dtype = getattr(torch, config_dtype) if isinstance(config_dtype, str) else config_dtype
    return torch.bfloat16 if config_dtype == torch.bfloat16 else torch.float16


# --------------------------------------------------------------------------- requests


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    extra_key: str | None = None
    ignore_eos: bool = False
    arrived: float = field(default_factory=time.monotonic)
    # scheduler state
    cache: object | None = None   # the request's transformers DynamicCache
    computed: int = 0             # tokens of input_ids + output_ids whose KV is in the cache
    cached_tokens: int = 0        # prompt tokens taken from the prefix cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    error: tuple[int, str] | None = None  # (HTTP status, message)
    done: threading.Event = field(default_factory=threading.Event)
    finished_at: float | None = None

    def __post_init__(self):
        self.prompt_hash = prompt_hash(self.input_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    def tokens(self, start: int, n: int) -> list[int]:
        seq = self.input_ids + self.output_ids
        return seq[start:start + n]


def parse_generate_request(body: bytes, tokenizer, vocab_size: int, context_length: int) -> Request:
    """Validate a /generate body (SGLang's shape) into a Request; BadRequest says what is wrong."""
    try:
        obj = json.loads(body or b"")
    except ValueError as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(obj).__name__}")
    if obj.get("stream"):
        raise BadRequest("streaming is not supported by the transformers engine")
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if text is None and input_ids is None:
        raise BadRequest("Either text or input_ids should be provided.")
    if text is not None and input_ids is not None:
        raise BadRequest("provide text or input_ids, not both")
    rid = obj.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest(f"rid must be a non-empty string (batched requests are not supported), not {rid!r}")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest(f"rid {rid!r}: text must be a string (batched requests are not supported)")
        input_ids = tokenizer(text).input_ids
    if (not isinstance(input_ids, list) or not input_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids)):
        raise BadRequest(f"rid {rid!r}: input_ids must be a non-empty list of integers")
    for i, t in enumerate(input_ids):
        if not 0 <= t < vocab_size:
            raise BadRequest(f"rid {rid!r}: input_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    params = obj.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest(f"rid {rid!r}: sampling_params must be a JSON object")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise BadRequest(f"rid {rid!r}: max_new_tokens must be a non-negative integer, not {max_new_tokens!r}")
    n = len(input_ids)
    if n >= context_length:
        raise BadRequest(f"rid {rid!r}: the input ({n} tokens) is longer than the model's context length "
                         f"({context_length} tokens)")
    if n + max_new_tokens > context_length:
        raise BadRequest(f"rid {rid!r}: requested token count exceeds the model's maximum context length of "
                         f"{context_length} tokens: {n} input tokens plus {max_new_tokens} new tokens")
    extra_key = obj.get("extra_key")
    if extra_key is not None and not isinstance(extra_key, str):
        raise BadRequest(f"rid {rid!r}: extra_key must be a string")
    return Request(rid=rid, input_ids=input_ids, max_new_tokens=max_new_tokens, extra_key=extra_key,
                   ignore_eos=bool(params.get("ignore_eos", False)))


# --------------------------------------------------------------------------- prefix cache


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """KV of finished sequences, keyed by (extra_key, token ids), LRU-bounded in tokens.

    A flat stand-in for SGLang's radix tree: the same observable effect (longest cached
    prefix reused, ``cached_tokens`` reported) without sharing pages between entries.
    """

    def __init__(self, max_tokens: int = PREFIX_CACHE_MAX_TOKENS):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], object] = OrderedDict()
        self._tokens = 0

    def match(self, namespace: str, ids: Sequence[int], limit: int) -> tuple[int, object | None]:
        """The longest cached prefix of ``ids`` (at most ``limit`` tokens) and a cropped copy of its KV."""
        best, best_key = 0, None
        for key in self._entries:
            if key[0] == namespace:
                n = min(common_prefix_len(key[1], ids), limit)
                if n > best:
                    best, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = copy.deepcopy(self._entries[best_key])
        surplus = kv.get_seq_length() - best
        if surplus:
            kv.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
        return best, kv

    def insert(self, namespace: str, ids: Sequence[int], kv) -> None:
        key = (namespace, tuple(ids))
        if key in self._entries:
            self._tokens -= len(key[1])
            del self._entries[key]
        self._entries[key] = kv
        self._tokens += len(ids)
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            old, _ = self._entries.popitem(last=False)
            self._tokens -= len(old[1])

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def stats(self) -> dict:
        return {"entries": len(self._entries), "tokens": self._tokens, "max_tokens": self.max_tokens}


# --------------------------------------------------------------------------- scheduling


def plan_step(running: Sequence[Request], prefill_budget: int | None, mixed: bool) -> list[tuple[Request, int]]:
    """Which requests run in the next step and how many tokens each feeds, in request order.

    Prefill chunks share ``prefill_budget`` tokens (None: unlimited); a step with
    prefill work takes decoding requests only when ``mixed``; a step without takes
    every decoding request, one token each.
    """
    left = prefill_budget
    plan: list[tuple[Request, int]] = []
    has_prefill = False
    for req in running:
        if req.prefilling:
            if left is not None and left <= 0:
                continue
            n = req.prompt_len - req.computed
            if left is not None:
                n = min(n, left)
                left -= n
            plan.append((req, n))
            has_prefill = True
        else:
            plan.append((req, 1))
    if has_prefill and not mixed:
        plan = [(r, n) for r, n in plan if r.prefilling]
    return plan


@dataclass
class StepBatch:
    """One forward step laid out as a flat batch: rows of all requests, in request order."""

    requests: list[Request]
    extend_seq_lens: list[int]
    extend_prefix_lens: list[int]
    is_prefill: list[bool]
    input_ids: torch.Tensor              # int64 [rows]
    hidden_states: list[torch.Tensor]    # HF hidden_states, each [rows, H]; the last is after the final norm
    prenorm_hidden_states: torch.Tensor  # [rows, H], the input of the final norm


class DumpHook:
    """Cuts a step's flat batch into per-request pieces with slice_extend_batch and queues them."""

    def __init__(self, writer: DumpWriter, layer_ids: Sequence[int], every_forward: bool):
        self.writer, self.layer_ids, self.every_forward = writer, list(layer_ids), every_forward

    def wanted(self, batch: StepBatch) -> list[bool]:
        if self.every_forward:
            return [True] * len(batch.requests)
        return [p and self.writer.wants(r.rid) for r, p in zip(batch.requests, batch.is_prefill)]

    def __call__(self, batch: StepBatch) -> None:
        wanted = self.wanted(batch)
        if not any(wanted):
            return
        rows = slice_extend_batch([r.rid for r in batch.requests], batch.extend_seq_lens,
                                  batch.extend_prefix_lens, int(batch.input_ids.numel()), batch.is_prefill)
        pieces = [PieceRows(r.rid, r.chunk_start, r.row_start, r.row_end, req.prompt_len, req.prompt_hash,
                            "extend" if r.is_prefill else "decode")
                  for req, r, want in zip(batch.requests, rows, wanted) if want]
        capture_pieces(self.writer, pieces, batch.input_ids.to(batch.hidden_states[-1].device),
                       [batch.hidden_states[i] for i in self.layer_ids], batch.hidden_states[-1],
                       batch.prenorm_hidden_states)


class FinalNormInput:
    """The input of the model's final norm in the last forward: the pre-norm final state.

    HF ``hidden_states[-1]`` is the norm's output; its input is seen only by a forward
    pre-hook on ``model.model.norm``.
    """

    def __init__(self, model):
        self.value: torch.Tensor | None = None
        model.model.norm.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.value = args[0]

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("the forward did not run the model's final norm (model.model.norm)")
        return value


class Scheduler:
    """The one thread that runs forwards; HTTP threads submit requests and wait on ``done``."""

    def __init__(self, model, *, eos_ids: set[int], prefill_budget: int | None, mixed: bool,
                 max_running: int, prefix_cache: PrefixCache | None, dump_hook: DumpHook | None):
        self.model = model
        self.device = next(model.parameters()).device
        # transformers >= 5.2x names the KV argument ``cache``; earlier 5.x releases ``past_key_values``.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.eos_ids = eos_ids
        self.prefill_budget, self.mixed, self.max_running = prefill_budget, mixed, max_running
        self.prefix_cache, self.dump_hook = prefix_cache, dump_hook
        self._final_norm_input = FinalNormInput(model)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._in_flight: set[str] = set()
        self._stopping = False
        self.steps = 0
        self.peak_running = 0
        self.forward_time_s = 0.0  # time spent in forward steps: the benchmark's pipeline efficiency
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._stopping:
                raise Refused(f"rid {req.rid!r}: the server is shutting down")
            if req.rid in self._in_flight:
                raise BadRequest(f"Duplicate request ID detected: {req.rid!r}")
            self._in_flight.add(req.rid)
            self._waiting.append(req)
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return bool(self._waiting or self._running)

    def load(self) -> dict:
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting), "steps": self.steps,
                    "peak_running": self.peak_running, "forward_time_s": self.forward_time_s}

    def flush_cache(self) -> None:
        with self._cond:
            # A request answered in this step leaves _running only when the step ends: it is not pending.
            if self._waiting or any(not req.done.is_set() for req in self._running):
                raise BadRequest("Cache not flushed because there are pending requests.")
            if self.prefix_cache is not None:
                self.prefix_cache.clear()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def stop(self, reason: str) -> None:
        """Stop the thread after its current step; refuse what has not finished."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            for req in list(self._waiting) + self._running:
                self._fail(req, 503, f"rid {req.rid!r}: {reason}")
            self._waiting.clear()
            self._running.clear()

    # -- thread side

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._waiting or self._running):
                    self._cond.wait()
                if self._stopping:
                    return
                self._admit()
                plan = plan_step(self._running, self.prefill_budget, self.mixed)
            started = time.perf_counter()
            try:
                self._step(plan)
            except Exception as exc:  # answered as HTTP 500 to the step's requests; the server goes on
                log.exception("forward step failed for rids %s", [r.rid for r, _ in plan])
                with self._cond:
                    for req, _ in plan:
                        if not req.done.is_set():
                            self._fail(req, 500, f"rid {req.rid!r}: forward failed: {type(exc).__name__}: {exc}")
            with self._cond:
                self.steps += 1
                self.forward_time_s += time.perf_counter() - started
                for req, _ in plan:
                    if req.done.is_set():
                        self._running.remove(req)
                self._cond.notify_all()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting.popleft()
            if self.prefix_cache is not None:
                n, kv = self.prefix_cache.match(req.extra_key or "", req.input_ids, req.prompt_len - 1)
                if kv is not None:
                    req.cache, req.computed, req.cached_tokens = kv, n, n
            self._running.append(req)
        self.peak_running = max(self.peak_running, len(self._running))

    def _step(self, plan: list[tuple[Request, int]]) -> None:
        from transformers import DynamicCache

        seq_lens, prefix_lens, is_prefill, ids, hidden, prenorm, last_logits = [], [], [], [], [], [], []
        with torch.inference_mode():
            for req, n in plan:
                chunk = req.tokens(req.computed, n)
                if req.cache is None:
                    req.cache = DynamicCache(config=self.model.config)
                out = self.model(input_ids=torch.tensor([chunk], device=self.device), use_cache=True,
                                 output_hidden_states=True, logits_to_keep=1, **{self._cache_kwarg: req.cache})
                seq_lens.append(n)
                prefix_lens.append(req.computed)
                is_prefill.append(req.prefilling)
                ids.extend(chunk)
                hidden.append([h[0] for h in out.hidden_states])
                prenorm.append(self._final_norm_input.take()[0])
                last_logits.append(out.logits[0, -1])
            if self.dump_hook is not None:
                batch = StepBatch([r for r, _ in plan], seq_lens, prefix_lens, is_prefill,
                                  torch.tensor(ids, dtype=torch.int64),
                                  [torch.cat(layer) for layer in zip(*hidden)], torch.cat(prenorm))
                self.dump_hook(batch)
            for (req, n), logits in zip(plan, last_logits):
                req.computed += n
                if req.prefilling:
                    continue
                if req.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                    continue
                token = int(logits.argmax())
                req.output_ids.append(token)
                if token in self.eos_ids and not req.ignore_eos:
                    self._finish(req, {"type": "stop", "matched": token})
                elif len(req.output_ids) >= req.max_new_tokens:
                    self._finish(req, {"type": "length", "length": req.max_new_tokens})

    def _finish(self, req: Request, reason: dict) -> None:
        if self.prefix_cache is not None:
            with self._cond:
                self.prefix_cache.insert(req.extra_key or "", req.tokens(0, req.computed), req.cache)
        req.cache = None
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        with self._cond:
            self._in_flight.discard(req.rid)
        req.done.set()

    def _fail(self, req: Request, status: int, message: str) -> None:
        req.cache = None
        req.error = (status, message)
        self._in_flight.discard(req.rid)
        req.done.set()


# --------------------------------------------------------------------------- the server


class LocalServer:
    """Model, tokenizer, dump writer and scheduler of one server process."""

    def __init__(self, args: argparse.Namespace):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.args = args
        config = AutoConfig.from_pretrained(args.model_path)
        self.dtype = resolve_dtype(args.dtype, getattr(config, "dtype", None))
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=self.dtype).to(args.device).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.context_length = args.context_length or int(self.model.config.max_position_embeddings)
        layer_ids = tuple(args.dump_aux_layers or default_aux_layer_ids(self.num_layers))
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise SystemExit(f"--dump-aux-layers {bad}: HF hidden_states indices must lie in [0, {self.num_layers})")
        self.writer = DumpWriter(DumpSettings(
            dump_dir=args.dump_dir, rid_prefix=args.dump_rid_prefix, model=str(args.model_path),
            layer_ids=layer_ids, max_pending_bytes=args.dump_max_pending_bytes, max_dir_bytes=args.dump_max_bytes,
            instance=args.dump_instance or uuid.uuid4().hex))
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            self.model, eos_ids=eos_ids,
            prefill_budget=None if args.chunked_prefill_size == -1 else args.chunked_prefill_size,
            mixed=args.enable_mixed_chunk, max_running=args.max_running_requests,
            prefix_cache=None if args.disable_radix_cache else PrefixCache(),
            dump_hook=DumpHook(self.writer, layer_ids, args.dump_every_forward))
        self.layer_ids = layer_ids
        self.ready = threading.Event()
        self.accepting = True
        self._http_lock = threading.Lock()
        self.http_in_flight = 0

    # -- request handling (called from HTTP threads)

    def generate(self, body: bytes) -> tuple[int, dict]:
        if not self.accepting:
            raise Refused("the server is shutting down")
        req = parse_generate_request(body, self.tokenizer, self.vocab_size, self.context_length)
        return self.run(req)

    def run(self, req: Request, timeout: float | None = None) -> tuple[int, dict]:
        self.scheduler.submit(req)
        if not req.done.wait(timeout):
            raise Refused(f"rid {req.rid!r}: no answer within {timeout}s")
        if req.error is not None:
            status, message = req.error
            return status, {"error": {"message": message}}
        return 200, {
            "text": self.tokenizer.decode(req.output_ids, skip_special_tokens=True),
            "output_ids": req.output_ids,
            "meta_info": {
                "id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": req.prompt_len,
                "completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens,
                "e2e_latency": req.finished_at - req.arrived,
            },
        }

    def health(self) -> tuple[int, dict | None]:
        if not self.ready.is_set():
            return 503, {"error": {"message": "the server is starting"}}
        if not self.accepting:
            return 503, {"error": {"message": "the server is shutting down"}}
        if self.scheduler.busy():  # SGLang answers from recent progress instead of adding a forward
            return 200, None
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0], max_new_tokens=1)
        status, body = self.run(req, timeout=HEALTH_TIMEOUT_S)
        return (200, None) if status == 200 else (503, body)

    def warmup(self) -> None:
        req = Request(rid=uuid.uuid4().hex, input_ids=self.tokenizer(WARMUP_TEXT).input_ids,
                      max_new_tokens=WARMUP_MAX_NEW_TOKENS)
        status, body = self.run(req, timeout=300)
        if status != 200:
            raise RuntimeError(f"warmup request {req.rid} failed: HTTP {status} {body}")

    def model_info(self) -> dict:
        cfg = self.model.config
        return {"model_path": str(self.args.model_path), "tokenizer_path": str(self.args.model_path),
                "is_generation": True, "model_type": cfg.model_type, "architectures": cfg.architectures,
                "num_hidden_layers": self.num_layers, "hidden_size": cfg.hidden_size,
                "vocab_size": self.vocab_size, "context_length": self.context_length,
                "dtype": str(self.dtype).removeprefix("torch."), "preferred_sampling_params": None,
                "weight_version": "default", "has_image_understanding": False}

    def server_info(self) -> dict:
        server_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()}
        if server_args.get("api_key"):
            server_args["api_key"] = "***"
        return {**server_args, "version": "local", "dump_aux_layer_ids": list(self.layer_ids),
                "dump_instance": self.writer.settings.instance,
                "dump_writer": self.writer.stats(), "scheduler": self.scheduler.load(),
                "prefix_cache": None if self.scheduler.prefix_cache is None else self.scheduler.prefix_cache.stats()}

    def flush_cache(self) -> tuple[int, str]:
        self.scheduler.flush_cache()
        return 200, "Cache flushed."

    def shutdown(self) -> None:
        """Refuse new requests, let running ones finish (or refuse them), drain the writer."""
        self.accepting = False
        if not self.scheduler.wait_idle(self.args.shutdown_grace_s):
            log.warning("requests still running after %.0fs; refusing them", self.args.shutdown_grace_s)
        self.scheduler.stop("the server is shutting down")
        self.writer.close()
        log.info("dump writer drained: %s", self.writer.stats())


class _Handler(BaseHTTPRequestHandler):
    server_version = "eagle3-local-server"

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def log_message(self, fmt, *args):  # per-request lines go to the debug log, not stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    def _route(self, method: str) -> None:
        app: LocalServer = self.server.app
        with app._http_lock:
            app.http_in_flight += 1
        try:
            self._dispatch(app, method)
        finally:
            with app._http_lock:
                app.http_in_flight -= 1

    def _dispatch(self, app: LocalServer, method: str) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        key = app.args.api_key
        if key and not path.startswith("/health") and self.headers.get("Authorization") != f"Bearer {key}":
            return self._send(401, {"error": "Unauthorized"})
        try:
            if path in ("/health", "/health_generate"):
                status, payload = app.health()
            elif path == "/generate" and method == "POST":
                status, payload = app.generate(body)
            elif path in ("/model_info", "/get_model_info"):
                status, payload = 200, app.model_info()
            elif path in ("/server_info", "/get_server_info"):
                status, payload = 200, app.server_info()
            elif path == "/flush_cache":
                status, payload = app.flush_cache()
            else:
                status, payload = 404, {"error": {"message": f"no route {method} {path}"}}
        except BadRequest as exc:
            log.warning("400 on %s %s: %s", method, path, exc)
            status, payload = 400, {"error": {"message": str(exc)}}
        except Refused as exc:
            status, payload = 503, {"error": {"message": str(exc)}}
        except Exception as exc:
            log.exception("500 on %s %s", method, path)
            status, payload = 500, {"error": {"message": f"{type(exc).__name__}: {exc}"}}
        self._send(status, payload)

    def _send(self, status: int, payload) -> None:
        if payload is None:
            data, ctype = b"", "text/plain"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            log.info("client of %s left before the answer: %s", self.path, exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    t0 = time.monotonic()
    app = LocalServer(args)
    httpd = ThreadingHTTPServer((args.host, args.port), _Handler)
    httpd.daemon_threads = True
    httpd.app = app
    app.scheduler.start()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    failed: list[BaseException] = []

    def warm_up() -> None:
        try:
            if not args.skip_server_warmup:
                app.warmup()
        except BaseException as exc:
            log.exception("warmup failed")
            failed.append(exc)
            stop.set()
            return
        app.ready.set()
        host, port = httpd.server_address[:2]
        log.info("server ready on http://%s:%d (model %s, %s on %s, dumps in %s, started in %.1fs)",
                 host, port, args.model_path, str(app.dtype).removeprefix("torch."), args.device,
                 args.dump_dir, time.monotonic() - t0)

    threading.Thread(target=warm_up, name="warmup", daemon=True).start()
    parent = os.getppid()
    while not stop.wait(0.5):
        if os.getppid() != parent:
            log.warning("the process that started this server (pid %d) is gone; stopping", parent)
            break
    log.info("stopping: no new requests; draining running requests and the dump writer")
    app.shutdown()
    deadline = time.monotonic() + 10
    while app.http_in_flight and time.monotonic() < deadline:  # let handlers send their answers
        time.sleep(0.02)
    httpd.shutdown()
    httpd.server_close()
    log.info("stopped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
