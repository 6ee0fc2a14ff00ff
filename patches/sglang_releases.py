"""The SGLang releases the dump hook supports, and every SGLang symbol it relies on.

One place: ``patches.launch`` refuses a release not named here, ``patches.sglang_hook``
imports the modules and reads the attributes listed here, and
``tests/test_sglang_source.py`` checks each symbol against the unpacked source of each
supported release (by parsing it: importing SGLang needs a GPU stack). An SGLang
upgrade that moves one of them fails that test, not a training run.

This module must import inside an SGLang server process: standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: How the aux hidden states reach the logits processor.
#: ``builtin``: SGLang's own EAGLE-3 capture (``set_eagle3_layers_to_capture``), switched
#: on without a draft model by ``--enable-return-aux-hidden-states`` (new in 0.5.23).
#: ``layer_hooks``: the release can switch that capture on only together with a draft
#: model, so forward hooks on the decoder layers compute the same expression SGLang's
#: capture computes, ``hidden_states + residual`` of the layer before the tap.
AuxCapture = Literal["builtin", "layer_hooks"]


@dataclass(frozen=True)
class Release:
    version: str
    aux_capture: AuxCapture
    #: ``architectures[0]`` of the model's config.json that the hook supports on this release.
    architectures: tuple[str, ...]
    why: str


SUPPORTED_RELEASES: dict[str, Release] = {
    r.version: r
    for r in (
        Release("0.5.17", "layer_hooks", ("LlamaForCausalLM",),
                "newest release that pins torch 2.11.0, the torch of the lent H200 nodes"),
        Release("0.5.23", "builtin", ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
                "newest release on PyPI (2026-12-02)"),
    )
}


# --------------------------------------------------------------------------- symbols

@dataclass(frozen=True)
class Symbol:
    """Something in SGLang's source the hook or the launcher relies on.

    kind:
      ``function``  ``name`` is ``func`` or ``Class.method``; ``params`` must be its leading
                    parameter names (``self`` excluded), in order.
      ``field``     ``name`` is ``Class.attr``: a class-level (annotated) assignment, or
                    ``self.attr = ...`` in one of the class's methods.
      ``member``    ``name`` is ``Enum.MEMBER``.
      ``flag``      ``name`` is a server-argument field; its CLI flag is ``--`` + dashes.
      ``source``    ``name`` is ``func`` or ``Class.method``; ``snippet`` must occur in
                    its ``ast.unparse`` text.
    ``releases``: the releases it is needed on (empty: all supported).
    """

    kind: Literal["function", "field", "member", "flag", "source"]
    module: str
    name: str
    why: str
    params: tuple[str, ...] = ()
    snippet: str = ""
    releases: tuple[str, ...] = ()

    def applies_to(self, version: str) -> bool:
        return not self.releases or version in self.releases


HOOK_MANAGER = "sglang.srt.model_executor.hook_manager"
FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor"
LLAMA = "sglang.srt.models.llama"
QWEN2 = "sglang.srt.models.qwen2"
QWEN3 = "sglang.srt.models.qwen3"
LAYERNORM = "sglang.srt.layers.layernorm"
RESIDUAL_BATCH = "sglang.srt.layers.layer_boundary.residual.batch"
RESIDUAL_ACCESS = "sglang.srt.layers.layer_boundary.residual.access"
#: Server-argument fields live in server_args.py (0.5.17) or arg_groups/fields/*.py (0.5.23).
SERVER_ARGS = "sglang.srt.server_args"

#: Module name under which the model's LogitsProcessor is registered (``self.logits_processor``).
LOGITS_PROCESSOR_MODULE = "logits_processor"
#: The model's final norm (``self.model.norm``), called as ``norm(hidden_states, residual)``.
FINAL_NORM_MODULE = "model.norm"
#: ``model.layers.{i}``: decoder layer i of a *ForCausalLM (``self.model.layers``).
DECODER_LAYER_MODULE = "model.layers.{}"

_V17, _V23 = ("0.5.17",), ("0.5.23",)

SYMBOLS: tuple[Symbol, ...] = (
    # -- how the hook gets into every scheduler subprocess
    Symbol("flag", SERVER_ARGS, "forward_hooks",
           "--forward-hooks JSON travels in ServerArgs to every scheduler subprocess"),
    Symbol("function", HOOK_MANAGER, "register_forward_hooks", "attaches the hooks after CUDA-graph capture",
           params=("model", "hook_specs")),
    Symbol("source", HOOK_MANAGER, "register_forward_hooks", "the hook factory is called with the spec's config",
           snippet="hook_factory(config)"),
    Symbol("source", HOOK_MANAGER, "register_forward_hooks", "a plain (args, output) forward hook per matched module",
           snippet="module.register_forward_hook(hook)"),
    Symbol("source", HOOK_MANAGER, "register_forward_hooks", "target modules are fnmatch patterns over named_modules",
           snippet="fnmatch.fnmatch(name, pattern)"),
    Symbol("function", HOOK_MANAGER, "resolve_callable", "'module:factory' path of the hook factory",
           params=("path",)),
    # -- the prompt of each request, read where the ForwardBatch is built from the ScheduleBatch
    Symbol("function", FORWARD_BATCH_INFO, "ForwardBatch.init_new", "wrapped to note each request's prompt",
           params=("batch", "model_runner")),
    Symbol("source", FORWARD_BATCH_INFO, "ForwardBatch.init_new", "rids are the ScheduleBatch's reqs, in order",
           snippet="[req.rid for req in batch.reqs]"),
    Symbol("field", SCHEDULE_BATCH, "ScheduleBatch.reqs", "the requests of the batch, in row order"),
    Symbol("field", SCHEDULE_BATCH, "Req.rid", "the request id: the dump's key"),
    Symbol("field", SCHEDULE_BATCH, "Req.origin_input_ids", "the whole prompt: its length and hash"),
    # -- what the hook reads from the ForwardBatch
    Symbol("field", FORWARD_BATCH_INFO, "ForwardBatch.forward_mode", "only EXTEND and MIXED forwards are dumped"),
    Symbol("field", FORWARD_BATCH_INFO, "ForwardBatch.rids", "request ids in row order"),
    Symbol("field", FORWARD_BATCH_INFO, "ForwardBatch.extend_seq_lens_cpu", "new rows of each request"),
    Symbol("field", FORWARD_BATCH_INFO, "ForwardBatch.extend_prefix_lens_cpu", "cached tokens before each chunk"),
    Symbol("member", FORWARD_BATCH_INFO, "ForwardMode.EXTEND", "a prefill (or a chunk of one)"),
    Symbol("member", FORWARD_BATCH_INFO, "ForwardMode.MIXED", "a prefill with decode rows riding along"),
    # -- the logits processor: the hook point
    Symbol("function", LOGITS_PROCESSOR, "LogitsProcessor.forward",
           "hook args: (input_ids, post-norm hidden states [T,H], lm_head, forward batch, aux)",
           params=("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")),
    Symbol("source", LLAMA, "LlamaForCausalLM.forward", "calls the logits processor positionally, aux fifth",
           snippet="self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)"),
    Symbol("field", LLAMA, "LlamaForCausalLM.logits_processor", "the module the dump hook is attached to"),
    Symbol("field", LLAMA, "LlamaForCausalLM.model", "decoder layers live at model.layers"),
    Symbol("field", LLAMA, "LlamaModel.layers", "decoder layers live at model.layers"),
    # -- which rank writes
    Symbol("function", PARALLEL_STATE, "get_attn_tensor_model_parallel_rank",
           "attention-TP rank 0 of each (attention-)DP group writes; the other TP ranks hold copies"),
    # -- the EAGLE-3 aux capture whose tensors the dump must equal
    Symbol("function", LLAMA, "LlamaForCausalLM.set_eagle3_layers_to_capture",
           "SGLang's EAGLE-3 capture: default [2, N//2, N-3], explicit id k captures layer k+1's input",
           params=("layer_ids",)),
    Symbol("source", LLAMA, "LlamaForCausalLM.set_eagle3_layers_to_capture", "the default taps",
           snippet="self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]"),
    Symbol("source", LLAMA, "LlamaForCausalLM.set_eagle3_layers_to_capture", "explicit ids shift by one",
           snippet="self.model.layers_to_capture = [val + 1 for val in layer_ids]"),
    Symbol("source", LLAMA, "LlamaModel.forward", "0.5.17 captures the residual stream entering layer i",
           snippet="aux_hidden_states.append(hidden_states + residual)", releases=_V17),
    Symbol("source", LLAMA, "LlamaDecoderLayer.forward", "0.5.17 layers return (hidden_states, residual)",
           snippet="return (hidden_states, residual)", releases=_V17),
    # -- the pre-norm final state: the final norm's (normed, hidden_states + residual) output
    Symbol("field", LLAMA, "LlamaModel.norm", "the final norm the pre-norm hook is attached to (model.norm)"),
    Symbol("source", LAYERNORM, "RMSNorm.forward_native", "with a residual, the norm returns (normed, the sum)",
           snippet="return (x, residual)"),
    Symbol("source", LAYERNORM, "RMSNorm.forward_native", "the returned residual is the pre-norm sum, rounded",
           snippet="residual = x.to(orig_dtype)"),
    Symbol("source", LAYERNORM, "RMSNorm.forward_cpu", "the CPU kernel returns (normed, the sum) too",
           snippet="return (x, residual)"),
    Symbol("source", LLAMA, "LlamaModel.forward", "0.5.17: the final norm takes the last layer's pair",
           snippet="hidden_states, _ = self.norm(hidden_states, residual)", releases=_V17),
    Symbol("source", LLAMA, "LlamaModel.forward", "0.5.23: the final norm through the residual stream",
           snippet="hidden_states = residual_batch.final_norm(hidden_states, forward_batch, self.norm)", releases=_V23),
    Symbol("source", QWEN2, "Qwen2Model.forward", "0.5.23: Qwen2's final norm through the residual stream",
           snippet="hidden_states = residual_batch.final_norm(hidden_states, forward_batch, self.norm, skip_empty=True)",
           releases=_V23),
    Symbol("source", QWEN3, "Qwen3Model.forward", "0.5.23: Qwen3's final norm through the residual stream",
           snippet="hidden_states = residual_batch.final_norm(hidden_states, forward_batch, self.norm, skip_empty=True)",
           releases=_V23),
    Symbol("source", RESIDUAL_BATCH, "final_norm", "0.5.23: a dense model's pair goes to final_norm_pair",
           snippet="return access.final_norm_pair(hidden_states, residual, layernorm, capture, **read_kwargs)",
           releases=_V23),
    Symbol("source", RESIDUAL_ACCESS, "final_norm_pair", "0.5.23: the norm is called with the pair, as a module",
           snippet="hidden_states, residual = norm(hidden_states, residual, **read_kwargs)", releases=_V23),
    Symbol("function", LOGITS_PROCESSOR, "LogitsProcessor.forward",
           "takes hidden_states_before_norm, which Llama and Qwen do not pass (hence the norm hook)",
           params=("input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states",
                   "hidden_states_before_norm")),
    Symbol("flag", SERVER_ARGS, "enable_return_aux_hidden_states", "aux capture without a draft", releases=_V23),
    Symbol("flag", SERVER_ARGS, "return_aux_hidden_state_layer_ids", "explicit EAGLE-3 taps (SGLang ids)",
           releases=_V23),
    Symbol("flag", SERVER_ARGS, "speculative_algorithm", "names the capture convention (EAGLE3)"),
    # -- flags the launcher reads or sets
    Symbol("flag", SERVER_ARGS, "model_path", "config.json gives the layer count and architecture"),
    Symbol("flag", SERVER_ARGS, "disable_prefill_cuda_graph", "the prefill graph replay drops ForwardBatch.rids"),
    Symbol("flag", SERVER_ARGS, "sleep_on_idle", "an idle scheduler parks in zmq poll instead of looping in Python"),
    Symbol("flag", SERVER_ARGS, "cuda_graph_backend_prefill", "an explicit prefill graph backend is refused"),
    Symbol("flag", SERVER_ARGS, "cuda_graph_config", "a JSON prefill graph backend is refused"),
    Symbol("source", "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
           "PrefillCudaGraphRunner.load_batch", "why: the replayed batch is rebuilt without rids",
           snippet="static_forward_batch = ForwardBatch("),
    Symbol("flag", SERVER_ARGS, "tp_size", "tensor parallelism: one rank writes"),
    Symbol("flag", SERVER_ARGS, "dp_size", "data parallelism: each DP rank writes its own requests"),
    Symbol("flag", SERVER_ARGS, "pp_size", "refused above 1: only the last stage sees the final states"),
    Symbol("flag", SERVER_ARGS, "attn_cp_size", "refused above 1: context parallelism splits a request's rows"),
    Symbol("flag", SERVER_ARGS, "dcp_size", "refused above 1: decode context parallelism"),
    Symbol("flag", SERVER_ARGS, "speculative_draft_model_path", "refused: speculative forwards are not prefills"),
    Symbol("flag", SERVER_ARGS, "enable_layernorm_sp", "refused: the logits processor's input is sequence-sharded",
           releases=_V23),
    Symbol("flag", SERVER_ARGS, "chunked_prefill_size", "allowed: every chunk carries its offset"),
    Symbol("flag", SERVER_ARGS, "enable_mixed_chunk", "allowed: decode rows are recognised and skipped"),
    Symbol("flag", SERVER_ARGS, "skip_server_warmup", "not needed: the warmup's rid has no dump prefix"),
    Symbol("flag", SERVER_ARGS, "disable_radix_cache", "a prefix-cache hit leaves the prompt's head undumped"),
    # -- the API key, set in-process by patches.sglang_serve (never on a command line)
    Symbol("flag", SERVER_ARGS, "api_key", "added to the parsed arguments in-process, from the environment"),
    Symbol("flag", SERVER_ARGS, "admin_api_key", "refused on the command line like --api-key"),
    Symbol("function", SERVER_ARGS, "prepare_server_args", "parses the arguments, the key among them",
           params=("argv",)),
    Symbol("function", "sglang.launch_server", "run_server", "launch_server's own start, given the ServerArgs",
           params=("server_args",)),
    Symbol("function", "sglang.srt.plugins", "load_plugins", "launch_server's main loads plugins first"),
    Symbol("function", "sglang.srt.utils.common", "kill_process_tree", "launch_server's main ends with it",
           params=("parent_pid", "include_parent")),
)


class UnsupportedSGLangRelease(RuntimeError):
    """The installed SGLang is not one the hook was checked against."""

    def __init__(self, found: str | None):
        self.found = found
        supported = ", ".join(SUPPORTED_RELEASES)
        what = f"SGLang {found} is installed" if found else "SGLang is not installed"
        super().__init__(f"{what}; the dump hook supports SGLang {supported} "
                         f"(patches/sglang_releases.py names them; tests/test_sglang_source.py checks them)")


def release(version: str | None) -> Release:
    """The supported release ``version``, or UnsupportedSGLangRelease."""
    if version not in SUPPORTED_RELEASES:
        raise UnsupportedSGLangRelease(version)
    return SUPPORTED_RELEASES[version]
