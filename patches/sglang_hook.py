"""The hidden-state dump hook that runs inside a real SGLang server.

How it gets in: SGLang's own ``--forward-hooks`` option (``patches.launch`` writes it).
``ModelRunner`` calls ``hook_manager.register_forward_hooks`` in every scheduler
subprocess after CUDA-graph capture and before serving; the JSON (with our settings as
each spec's ``config``) travels there inside ServerArgs, and ``resolve_callable``
imports this module there, so a hook installed in the parent, an env var or a ``.pth``
file are not needed; only ``patches`` must be importable (the launcher puts the project
on PYTHONPATH).

What it attaches, per process:
- a forward hook on the model's ``logits_processor``: its positional args are
  ``(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``, i.e. the
  batch's new tokens, the final hidden states after the norm for every row, and the
  EAGLE-3 aux list;
- a forward hook on the model's final norm (``model.norm``), called as
  ``norm(hidden_states, residual)`` on both releases: it returns ``(normed, residual)``, the
  residual updated to ``hidden_states + residual``, the last layer's output before the norm
  (the pre-norm final state; 0.5.23's decoder layers no longer return their residual, so
  the norm is the one place both releases show it). Llama and Qwen do not pass the logits
  processor ``hidden_states_before_norm`` on either release (only DeepSeek-V4 and a few MTP
  models do). The norm runs just before the logits processor in the same forward; the
  logits hook takes the pair only if the norm's output is the tensor it was handed;
- on releases whose EAGLE-3 capture needs a draft model (``layer_hooks``), forward hooks
  on the decoder layers before each tap that compute what SGLang's capture computes,
  ``hidden_states + residual`` (the residual stream entering the tap layer);
- a wrapper around ``ForwardBatch.init_new``, the one place where the ScheduleBatch's
  ``Req`` objects are at hand, that notes each wanted request's whole-prompt length and
  hash by rid (the model side only sees the chunk's new tokens, and a runner may hand
  the model a copy of the ForwardBatch that keeps only its dataclass fields).

Only EXTEND and MIXED forwards of rids with the dump prefix are dumped, on attention-TP
rank 0 (each DP rank has its own scheduler and writes its own requests). The rows leave
the GPU through :mod:`patches.capture`: a snapshot and its checksum on the forward's
stream, then a side-stream copy to pinned memory that the writer threads wait on, so the
scheduler never waits for a copy or a disk, and no later forward can change what is copied.

This module imports without SGLang (the launcher and the CPU tests use it); SGLang is
imported only inside the factories, which run in the server.
"""

from __future__ import annotations

import collections
import gc
import importlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from patches.batch_slicing import BatchLayoutError, slice_extend_batch
from patches.capture import PieceRows, Transfer, capture_pieces, to_host
from patches.dumps import DumpSettings, DumpWriter, prompt_hash
from patches.sglang_releases import (
    DECODER_LAYER_MODULE,
    FINAL_NORM_MODULE,
    FORWARD_BATCH_INFO,
    LOGITS_PROCESSOR_MODULE,
    PARALLEL_STATE,
    AuxCapture,
)

log = logging.getLogger(__name__)

#: ForwardMode names whose rows are prefill rows (MIXED: plus decode rows riding along).
DUMPED_FORWARD_MODES = ("EXTEND", "MIXED")
#: Where the layer hooks leave the aux states for the logits hook, on the forward's ForwardBatch.
AUX_ATTR = "eagle3_dump_aux"

LOGITS_HOOK_FACTORY = "patches.sglang_hook:make_logits_hook"
LAYER_HOOK_FACTORY = "patches.sglang_hook:make_aux_layer_hook"
FINAL_NORM_HOOK_FACTORY = "patches.sglang_hook:make_final_norm_hook"


@dataclass(frozen=True)
class PromptInfo:
    """What the dump metadata needs of the whole prompt, read from ``Req.origin_input_ids``."""

    prompt_len: int
    prompt_hash: str


# --------------------------------------------------------------------------- the tensor logic


def dump_extend_batch(
    writer: DumpWriter,
    *,
    rids: Sequence[str] | None,
    prompts: Sequence[PromptInfo | None],
    extend_seq_lens: Sequence[int],
    extend_prefix_lens: Sequence[int],
    forward_mode: str,
    input_ids: torch.Tensor,
    final_hidden_states: torch.Tensor,
    prenorm_hidden_states: torch.Tensor | None,
    aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor | None,
    num_aux_layers: int,
    transfer: Transfer = to_host,
) -> list[str]:
    """Submit one piece per wanted request of one forward; returns the rids submitted.

    ``final_hidden_states`` [rows, H] (after the final norm), ``prenorm_hidden_states`` [rows, H]
    (before it) and ``aux_hidden_states`` (a list of ``num_aux_layers`` tensors [rows, H], or one
    packed [rows, k*H]) cover the whole flat batch; rows past the
    requests' are padding. A request's piece holds its rows up to the end of its prompt:
    rows of a decode step (a request whose prefix already covers its prompt) and output
    tokens of a re-prefilled request are not part of the prompt. A batch that does not add
    up leaves an error marker for each wanted rid and is otherwise skipped. The rows are
    taken off the GPU by :func:`patches.capture.capture_pieces` (snapshot, checksum, transfer).
    """
    if forward_mode not in DUMPED_FORWARD_MODES or not rids:
        return []
    wanted = [i for i, rid in enumerate(rids) if writer.wants(rid)]
    if not wanted:
        return []

    def fail_all(reason: str) -> list[str]:
        for i in wanted:
            writer.fail(rids[i], reason)
        return []

    if len(prompts) != len(rids):
        return fail_all(f"{len(rids)} rids but {len(prompts)} prompt notes in a {forward_mode} batch")
    aux_parts = _split_aux(aux_hidden_states, num_aux_layers, final_hidden_states)
    if isinstance(aux_parts, str):
        return fail_all(aux_parts)
    if prenorm_hidden_states is None or prenorm_hidden_states.shape[-1:] != final_hidden_states.shape[-1:]:
        return fail_all("no pre-norm final state reached the logits processor: the hook on the model's final norm "
                        f"({FINAL_NORM_MODULE}) did not see this forward's norm; start the server with python -m patches.launch")
    num_rows = min(int(final_hidden_states.shape[0]), int(prenorm_hidden_states.shape[0]), int(input_ids.shape[0]),
                   *(int(a.shape[0]) for a in aux_parts))
    is_prefill = [p is not None and int(prefix) < p.prompt_len for p, prefix in zip(prompts, extend_prefix_lens)]
    try:
        layout = slice_extend_batch(rids, extend_seq_lens, extend_prefix_lens, num_rows, is_prefill)
    except BatchLayoutError as exc:
        return fail_all(f"{forward_mode} batch layout: {exc}")

    pieces = []
    for i in wanted:
        rows, prompt = layout[i], prompts[i]
        if prompt is None:
            writer.fail(rows.rid, "no prompt noted for it: ForwardBatch.init_new did not see it in this process")
            continue
        if not rows.is_prefill or rows.n == 0:
            continue
        n = min(rows.n, prompt.prompt_len - rows.chunk_start)
        pieces.append(PieceRows(rows.rid, rows.chunk_start, rows.row_start, rows.row_start + n,
                                prompt.prompt_len, prompt.prompt_hash))
    return capture_pieces(writer, pieces, input_ids, aux_parts, final_hidden_states, prenorm_hidden_states, transfer)


def _split_aux(aux, k: int, final: torch.Tensor) -> list[torch.Tensor] | str:
    """The aux states as k tensors [rows, H], or the reason they cannot be used."""
    if aux is None or (not isinstance(aux, torch.Tensor) and len(aux) == 0):
        return ("no aux hidden states reached the logits processor: SGLang's EAGLE-3 capture (or, on "
                "layer_hooks releases, the decoder-layer hooks) is off; start the server with python -m patches.launch")
    h = int(final.shape[-1])
    if isinstance(aux, torch.Tensor):
        if aux.dim() != 2 or aux.shape[-1] != k * h:
            return f"packed aux hidden states of shape {tuple(aux.shape)}, expected [rows, {k}*{h}]"
        return list(aux.split(h, dim=-1))
    parts = list(aux)
    if len(parts) != k or any(p.dim() != 2 or p.shape[-1] != h for p in parts):
        shapes = [tuple(p.shape) for p in parts]
        return f"aux hidden states {shapes}, expected {k} tensors [rows, {h}]"
    return parts


# --------------------------------------------------------------------------- the hook config


@dataclass(frozen=True)
class HookConfig:
    """The JSON-able settings every scheduler subprocess receives in its hook spec's config."""

    dump: DumpSettings
    aux_capture: AuxCapture

    def to_json(self) -> dict:
        return {"dump": self.dump.to_json(), "aux_capture": self.aux_capture}

    @classmethod
    def from_json(cls, d: dict) -> "HookConfig":
        return cls(DumpSettings.from_json(d["dump"]), d["aux_capture"])


def forward_hook_specs(config: HookConfig) -> list[dict]:
    """The ``--forward-hooks`` entries for this config (what ``patches.launch`` passes)."""
    specs = [{"name": "eagle3-dump", "target_modules": [LOGITS_PROCESSOR_MODULE],
              "hook_factory": LOGITS_HOOK_FACTORY, "config": config.to_json()},
             {"name": "eagle3-final-norm", "target_modules": [FINAL_NORM_MODULE],
              "hook_factory": FINAL_NORM_HOOK_FACTORY, "config": config.to_json()}]
    if config.aux_capture == "layer_hooks":
        # HF hidden_states[i] is the residual stream entering layer i = the output of layer i-1.
        for layer_id in config.dump.layer_ids:
            specs.append({"name": f"eagle3-aux-{layer_id}", "target_modules": [DECODER_LAYER_MODULE.format(layer_id - 1)],
                          "hook_factory": LAYER_HOOK_FACTORY, "config": {**config.to_json(), "layer_id": layer_id}})
    return specs


# --------------------------------------------------------------------------- inside the server


def long_collection_logger(threshold_s: float) -> Callable[[str, dict], None]:
    """A ``gc.callbacks`` entry that logs each garbage collection longer than ``threshold_s``: it stops
    the forward and the dump writer's threads alike (SGLang 0.5.17 logs long collections only in its
    tokenizer process, not in the scheduler, where the writer runs)."""
    started: dict[object, float] = {}

    def callback(phase: str, info: dict) -> None:
        generation = info.get("generation")
        if phase == "start":
            started[generation] = time.monotonic()
        elif generation in started:
            took = time.monotonic() - started.pop(generation)
            if took > threshold_s and not sys.is_finalizing():  # at exit the handlers may be closed already
                log.warning("eagle3 dump hook: a generation-%s garbage collection stopped this process for %.2f s "
                            "(%s objects collected)", generation, took, info.get("collected"))
    return callback


#: collections logged when longer (a forward of 64 prompts takes ~0.8 s; a dump lands within ~0.1 s)
LONG_COLLECTION_S = 0.2


class _ProcessState:
    """One per server process: the writer (on the writing rank) and the init_new wrapper."""

    def __init__(self, config: HookConfig):
        self.config = config
        parallel_state = importlib.import_module(PARALLEL_STATE)
        self.attn_tp_rank = int(parallel_state.get_attn_tensor_model_parallel_rank())
        self.writer = DumpWriter(config.dump) if self.attn_tp_rank == 0 else None
        self.hashes = _PromptHashCache()
        #: (normed, pre-norm) of the last final-norm call, taken by the logits hook of the same forward
        self.final_norm_output: tuple[torch.Tensor, torch.Tensor] | None = None
        self.warned_unnoted = False
        if self.writer is not None:
            _wrap_init_new(self)
            gc.callbacks.append(long_collection_logger(LONG_COLLECTION_S))
        log.info("eagle3 dump hook: attention-TP rank %d %s dumps of rids %r to %s (layers %s, aux %s)",
                 self.attn_tp_rank, "writes" if self.writer else "does not write", config.dump.rid_prefix,
                 config.dump.dump_dir, list(config.dump.layer_ids), config.aux_capture)

    def take_prenorm(self, normed: torch.Tensor) -> torch.Tensor | None:
        """The pre-norm final state of the norm call whose output is ``normed`` (None if that was not
        the last norm call seen); forgotten either way, so no later forward can take it."""
        pair, self.final_norm_output = self.final_norm_output, None
        return pair[1] if pair is not None and pair[0] is normed else None

    def note_prompts(self, reqs: Sequence[Any]) -> None:
        for req in reqs:
            if self.writer.wants(req.rid):
                self.hashes.get(req)

    def wanted_prompts(self, forward_batch) -> tuple[PromptInfo | None, ...] | None:
        """Per request of a prefill forward with a wanted rid, its noted prompt; None for other forwards.

        Looked up by rid, not carried on the ForwardBatch: the runners copy the batch
        into static buffers (``EagerRunner.load_batch``) and the copy keeps only its fields.
        """
        if forward_batch.forward_mode.name not in DUMPED_FORWARD_MODES:
            return None
        rids = forward_batch.rids
        if rids is None:
            if not self.warned_unnoted:
                self.warned_unnoted = True
                log.error("eagle3 dump hook: an %s forward reached the model without rids (the prefill CUDA "
                          "graph path?); its requests cannot be dumped. Launch with python -m patches.launch, "
                          "which disables the prefill CUDA graph.", forward_batch.forward_mode.name)
            return None
        if not any(self.writer.wants(rid) for rid in rids):
            return None
        return tuple(self.hashes.peek(rid) if self.writer.wants(rid) else None for rid in rids)


class _PromptHashCache:
    """Prompt hashes by rid, so a long prompt prefilled in many chunks is hashed once."""

    def __init__(self, max_entries: int = 1 << 16):
        self._entries: collections.OrderedDict[str, tuple[int, int, PromptInfo]] = collections.OrderedDict()
        self._max = max_entries

    def get(self, req: Any) -> PromptInfo:
        ids = req.origin_input_ids
        key = (id(ids), len(ids))
        hit = self._entries.get(req.rid)
        if hit is not None and hit[:2] == key:
            return hit[2]
        info = PromptInfo(len(ids), prompt_hash(ids))
        self._entries[req.rid] = (*key, info)
        self._entries.move_to_end(req.rid)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return info

    def peek(self, rid: str) -> PromptInfo | None:
        hit = self._entries.get(rid)
        return None if hit is None else hit[2]


_state_lock = threading.Lock()
_state: _ProcessState | None = None


def _process_state(config: HookConfig) -> _ProcessState:
    global _state
    with _state_lock:
        if _state is None:
            _state = _ProcessState(config)
        elif _state.config != config:
            raise RuntimeError(f"two eagle3 dump hook configs in one process: {_state.config} and {config}")
        return _state


def _wrap_init_new(state: _ProcessState) -> None:
    """Note each wanted request's prompt, by rid, whenever a prefill ForwardBatch is built."""
    forward_batch_cls = importlib.import_module(FORWARD_BATCH_INFO).ForwardBatch
    original = forward_batch_cls.init_new
    if getattr(original, "__eagle3_dump_wrapped__", False):
        return
    original_func = original.__func__

    def init_new(cls, batch, model_runner, *args, **kwargs):
        forward_batch = original_func(cls, batch, model_runner, *args, **kwargs)
        if forward_batch.forward_mode.name in DUMPED_FORWARD_MODES:
            state.note_prompts(batch.reqs)
        return forward_batch

    init_new.__eagle3_dump_wrapped__ = True
    forward_batch_cls.init_new = classmethod(init_new)


def make_logits_hook(config: dict) -> Callable | None:
    """Hook factory for the logits processor (``--forward-hooks`` calls it in each process)."""
    hook_config = HookConfig.from_json(config)
    state = _process_state(hook_config)
    if state.writer is None:
        return None  # SGLang logs that this rank registers no hook
    writer, builtin = state.writer, hook_config.aux_capture == "builtin"

    def hook(module, args, output):
        input_ids, hidden_states, forward_batch = args[0], args[1], args[3]
        # Popped whatever the forward: a runner may hand the same static batch object to the next one.
        captured = forward_batch.__dict__.pop(AUX_ATTR, {})
        prenorm = state.take_prenorm(hidden_states)
        prompts = state.wanted_prompts(forward_batch)
        if prompts is None:
            return None
        if builtin:
            aux = args[4] if len(args) > 4 else None
        else:
            aux = [captured[i] for i in hook_config.dump.layer_ids] if len(captured) == len(hook_config.dump.layer_ids) else None
        dump_extend_batch(
            writer, rids=forward_batch.rids, prompts=prompts,
            extend_seq_lens=forward_batch.extend_seq_lens_cpu, extend_prefix_lens=forward_batch.extend_prefix_lens_cpu,
            forward_mode=forward_batch.forward_mode.name, input_ids=input_ids, final_hidden_states=hidden_states,
            prenorm_hidden_states=prenorm, aux_hidden_states=aux, num_aux_layers=len(hook_config.dump.layer_ids))
        return None

    return hook


def make_aux_layer_hook(config: dict) -> Callable | None:
    """Hook factory for the decoder layer before tap ``config['layer_id']`` (``layer_hooks`` releases)."""
    layer_id = int(config["layer_id"])
    state = _process_state(HookConfig.from_json({k: v for k, v in config.items() if k != "layer_id"}))
    if state.writer is None:
        return None

    def hook(module, args, output):
        forward_batch = args[2]
        if state.wanted_prompts(forward_batch) is None:
            return None  # not a batch with a wanted prefill: nothing to capture
        hidden_states, residual = output
        # The same expression SGLang's EAGLE-3 capture evaluates before layer `layer_id`
        # runs (LlamaModel.forward); computed now, before that layer's fused norm
        # overwrites both tensors in place.
        forward_batch.__dict__.setdefault(AUX_ATTR, {})[layer_id] = hidden_states + residual
        return None

    return hook


def make_final_norm_hook(config: dict) -> Callable | None:
    """Hook factory for the model's final norm: keeps its ``(normed, pre-norm)`` output for the logits hook."""
    state = _process_state(HookConfig.from_json(config))
    if state.writer is None:
        return None

    def hook(module, args, output):
        # norm(hidden_states, residual) returns (normed, hidden_states + residual). A reference,
        # not a copy: the logits hook snapshots the wanted rows right after, in the same forward.
        state.final_norm_output = (output[0], output[1]) if isinstance(output, tuple) and len(output) == 2 else None
        return None

    return hook
