"""The SGLang hook's tensor logic and the launcher's flag plan, on CPU without SGLang.

The batches are laid out as SGLang lays them out (new tokens of each request, in request
order, then padding); their rows are a real forward of the tiny model, so an assembled
dump can be compared with the model's own hidden states.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from patches import launch
from patches.dumps import DumpReader, DumpSettings, DumpWriteFailed, DumpWriter, default_aux_layer_ids, prompt_hash
from patches.sglang_hook import HookConfig, PromptInfo, dump_extend_batch, forward_hook_specs, long_collection_logger
from patches.sglang_releases import SUPPORTED_RELEASES, UnsupportedSGLangRelease, release
from tests.ground_truth import final_norm_input

PROMPTS = {
    "eagle3-long": list(range(5, 31)),      # 26 tokens, prefilled in three chunks
    "eagle3-short": [7, 3, 9, 11, 2, 40, 41],
    "warmup-uuid": [1, 2, 3],               # SGLang's warmup: no dump prefix
}


@pytest.fixture(scope="module")
def truth(tiny_model_dir):
    """rid -> (aux [T, 3H], final [T, H], pre-norm final [T, H]) from the model's own forward (HF
    hidden_states convention; the pre-norm state is the input of model.model.norm)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    layer_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    out = {}
    with torch.no_grad():
        for rid, ids in PROMPTS.items():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out[rid] = (torch.cat([hs[i][0] for i in layer_ids], -1), hs[-1][0], final_norm_input(model, ids))
    return layer_ids, out


def _writer(tmp_path, layer_ids, **kw):
    return DumpWriter(DumpSettings(dump_dir=tmp_path, rid_prefix="eagle3-", model="tiny", layer_ids=tuple(layer_ids), **kw))


def _run_batch(writer, truth, batch, padding=0, mode="EXTEND", packed=False, **overrides):
    """Lay out ``batch`` [(rid, prefix, n)] like SGLang and pass it through the hook's tensor logic."""
    layer_ids, states = truth
    ids, aux, final, prenorm, prompts = [], [], [], [], []
    for rid, prefix, n in batch:
        full = PROMPTS[rid]
        a, f, p = states[rid]
        if prefix >= len(full):  # a decode step: one row past the prompt (its values do not matter)
            ids.append(torch.tensor([99])), aux.append(torch.full((1, a.shape[1]), 7.0))
            final.append(torch.full((1, f.shape[1]), 7.0)), prenorm.append(torch.full((1, f.shape[1]), 7.0))
        else:
            ids.append(torch.tensor(full[prefix:prefix + n])), aux.append(a[prefix:prefix + n])
            final.append(f[prefix:prefix + n]), prenorm.append(p[prefix:prefix + n])
        prompts.append(PromptInfo(len(full), prompt_hash(full)) if writer.wants(rid) else None)
    h = final[0].shape[1]
    ids.append(torch.zeros(padding, dtype=torch.int64)), aux.append(torch.zeros(padding, 3 * h))
    final.append(torch.zeros(padding, h)), prenorm.append(torch.zeros(padding, h))
    aux_flat = torch.cat(aux)
    args = dict(rids=[r for r, _, _ in batch], prompts=prompts, extend_seq_lens=[n for _, _, n in batch],
                extend_prefix_lens=[p for _, p, _ in batch], forward_mode=mode, input_ids=torch.cat(ids),
                final_hidden_states=torch.cat(final), prenorm_hidden_states=torch.cat(prenorm),
                aux_hidden_states=aux_flat if packed else list(aux_flat.split(h, -1)), num_aux_layers=len(layer_ids))
    args.update(overrides)
    return dump_extend_batch(writer, **args)


def test_chunked_mixed_padded_batches_assemble_to_the_models_hidden_states(tmp_path, truth):
    writer = _writer(tmp_path, truth[0])
    # chunk 1 of "long" with all of "short" and the warmup; chunk 2 of "long" next to a decode
    # step of "short" (MIXED) and graph padding; chunk 3 alone, aux packed as 0.5.23 may pass it.
    assert _run_batch(writer, truth, [("eagle3-long", 0, 10), ("eagle3-short", 0, 7), ("warmup-uuid", 0, 3)]) \
        == ["eagle3-long", "eagle3-short"]
    assert _run_batch(writer, truth, [("eagle3-long", 10, 12), ("eagle3-short", 7, 1)], padding=5, mode="MIXED") \
        == ["eagle3-long"]
    assert _run_batch(writer, truth, [("eagle3-long", 22, 4)], packed=True) == ["eagle3-long"]
    writer.close()

    reader = DumpReader(tmp_path)
    for rid in ("eagle3-long", "eagle3-short"):
        dump = reader.assemble(rid, PROMPTS[rid])
        aux, final, prenorm = truth[1][rid]
        torch.testing.assert_close(dump.aux_hidden_states, aux, rtol=0, atol=0)
        torch.testing.assert_close(dump.final_hidden_states, final, rtol=0, atol=0)
        torch.testing.assert_close(dump.prenorm_hidden_states, prenorm, rtol=0, atol=0)
        assert not torch.equal(prenorm, final), "the tiny model's final norm changes the state"
        assert dump.layer_ids == truth[0]
    assert [p.chunk_start for p in reader.pieces("eagle3-long")] == [0, 10, 22]
    assert reader.piece_paths("warmup-uuid") == [], "the warmup's rid has no dump prefix"


def test_decode_and_other_forward_modes_are_not_dumped(tmp_path, truth):
    writer = _writer(tmp_path, truth[0])
    assert _run_batch(writer, truth, [("eagle3-short", 0, 7)], mode="DECODE") == []
    assert _run_batch(writer, truth, [("eagle3-short", 0, 7)], mode="TARGET_VERIFY") == []
    assert _run_batch(writer, truth, [("eagle3-short", 0, 7)], rids=None) == []
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_batch_that_does_not_add_up_leaves_error_markers_and_serving_goes_on(tmp_path, truth):
    writer = _writer(tmp_path, truth[0])
    _run_batch(writer, truth, [("eagle3-short", 0, 7)], extend_seq_lens=[9])          # more rows claimed than exist
    _run_batch(writer, truth, [("eagle3-long", 0, 10)], aux_hidden_states=None)      # capture off
    writer.close()
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpWriteFailed, match="layout"):
        reader.wait("eagle3-short", 7, timeout=1)
    with pytest.raises(DumpWriteFailed, match="EAGLE-3 capture"):
        reader.wait("eagle3-long", 26, timeout=1)



def test_a_forward_whose_final_norm_was_not_seen_leaves_error_markers(tmp_path, truth):
    writer = _writer(tmp_path, truth[0])
    _run_batch(writer, truth, [("eagle3-short", 0, 7)], prenorm_hidden_states=None)
    writer.close()
    with pytest.raises(DumpWriteFailed, match="no pre-norm final state"):
        DumpReader(tmp_path).wait("eagle3-short", 7, timeout=1)


def test_a_full_writer_budget_leaves_an_error_marker(tmp_path, truth):
    writer = _writer(tmp_path, truth[0], max_pending_bytes=100)
    assert _run_batch(writer, truth, [("eagle3-short", 0, 7)]) == []
    writer.close()
    with pytest.raises(DumpWriteFailed, match="budget"):
        DumpReader(tmp_path).wait("eagle3-short", 7, timeout=1)


# --------------------------------------------------------------------------- the launcher


def _plan(version, tmp_path, server_argv, dump_argv=(), model=("LlamaForCausalLM", 32)):
    args = launch.dump_arg_parser().parse_args(["--dump-dir", str(tmp_path), *dump_argv])
    return launch.plan_launch(SUPPORTED_RELEASES[version], args, ["--model-path", "/m", *server_argv], model=model)


def _hooks(plan):
    return json.loads(plan.argv[plan.argv.index("--forward-hooks") + 1])


def test_a_garbage_collection_longer_than_the_threshold_is_logged(caplog):
    for threshold, logged in ((60.0, 0), (0.0, 1)):
        callback = long_collection_logger(threshold)
        gc.callbacks.append(callback)
        try:
            with caplog.at_level("WARNING", logger="patches.sglang_hook"):
                caplog.clear()
                gc.collect()  # a real, full collection
        finally:
            gc.callbacks.remove(callback)
        lines = [r.getMessage() for r in caplog.records if "garbage collection" in r.getMessage()]
        assert len(lines) == logged, (threshold, lines)
    assert "generation-2" in lines[0]


def test_launch_on_0_5_23_uses_sglangs_capture_and_disables_the_prefill_graph(tmp_path):
    plan = _plan("0.5.23", tmp_path, ["--tp-size", "2", "--chunked-prefill-size", "4096"], ["--dump-aux-layers", "3", "10"])
    argv = plan.argv
    assert "--disable-prefill-cuda-graph" in argv
    assert argv.count("--sleep-on-idle") == 1, "an idle scheduler looping in Python starves the dump writer of the GIL"
    i = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[i + 1:i + 3] == ["2", "9"], "SGLang id k captures HF hidden_states[k+1]"
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3" and "--enable-return-aux-hidden-states" in argv
    hooks = _hooks(plan)
    assert [h["target_modules"] for h in hooks] == [["logits_processor"], ["model.norm"]]
    assert HookConfig.from_json(hooks[0]["config"]) == plan.hook_config
    assert plan.hook_config.dump.layer_ids == (3, 10) and plan.hook_config.dump.dump_dir == tmp_path.resolve()
    assert any("chunked-prefill-size 4096 is fine" in n for n in plan.notes)


def test_launch_on_0_5_17_hooks_the_layers_before_each_tap(tmp_path):
    plan = _plan("0.5.17", tmp_path, ["--sleep-on-idle"])
    assert "--enable-return-aux-hidden-states" not in plan.argv
    assert plan.argv.count("--sleep-on-idle") == 1, "given once, not added twice"
    hooks = _hooks(plan)
    assert [h["target_modules"] for h in hooks] == [["logits_processor"], ["model.norm"], ["model.layers.1"],
                                                     ["model.layers.15"], ["model.layers.28"]]
    assert [h["config"].get("layer_id") for h in hooks[2:]] == [2, 16, 29]
    assert forward_hook_specs(plan.hook_config) == hooks


def test_launch_merges_given_forward_hooks(tmp_path):
    mine = {"name": "probe", "target_modules": ["model.norm"], "hook_factory": "x:y"}
    plan = _plan("0.5.23", tmp_path, ["--forward-hooks", json.dumps([mine])])
    assert plan.argv.count("--forward-hooks") == 1 and _hooks(plan)[0] == mine


@pytest.mark.parametrize("server_argv, message", [
    (["--pp-size", "2"], "pp-size"),
    (["--attn-cp-size", "2"], "attn-cp-size"),
    (["--enable-layernorm-sp"], "sequence-sharded"),
    (["--cuda-graph-backend-prefill", "breakable"], "without rids"),
    (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "without rids"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"], "speculative"),
    (["--return-aux-hidden-state-layer-ids", "1", "2"], "--dump-aux-layers"),
])
def test_launch_refuses_flags_that_break_dumps(tmp_path, server_argv, message):
    with pytest.raises(launch.LaunchRefused, match=message):
        _plan("0.5.23", tmp_path, server_argv)


def test_launch_refuses_a_missing_dump_dir_bad_layers_and_unsupported_models(tmp_path):
    with pytest.raises(launch.LaunchRefused, match="does not exist"):
        _plan("0.5.23", tmp_path / "typo", [])
    with pytest.raises(launch.LaunchRefused, match=r"\[1, 32\)"):
        _plan("0.5.23", tmp_path, [], ["--dump-aux-layers", "0", "5", "9"])
    with pytest.raises(launch.LaunchRefused, match="Qwen3ForCausalLM"):
        _plan("0.5.17", tmp_path, [], model=("Qwen3ForCausalLM", 32))


def test_an_unsupported_release_names_found_and_supported_versions():
    with pytest.raises(UnsupportedSGLangRelease, match=r"SGLang 0\.5\.14 is installed.*0\.5\.17, 0\.5\.23"):
        release("0.5.14")
    with pytest.raises(UnsupportedSGLangRelease, match="not installed"):
        release(None)


def test_the_launcher_command_line_refuses_without_sglang(tmp_path, tiny_model_dir):
    """This venv has no SGLang: ``python -m patches.launch`` must say so and which releases it supports."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "patches.launch", "--dump-dir", str(tmp_path), "--",
                           "--model-path", str(tiny_model_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "SGLang is not installed" in done.stderr and "0.5.17, 0.5.23" in done.stderr


def test_the_launcher_reads_the_local_models_config(tmp_path, tiny_model_dir):
    args = launch.dump_arg_parser().parse_args(["--dump-dir", str(tmp_path)])
    plan = launch.plan_launch(SUPPORTED_RELEASES["0.5.23"], args, ["--model-path", str(tiny_model_dir)])
    assert plan.hook_config.dump.layer_ids == tuple(default_aux_layer_ids(8))


@pytest.fixture
def gc_callbacks_restored():
    """The process state's long-collection logger goes when the test does (gc.callbacks is the
    interpreter's own list: monkeypatch cannot swap it)."""
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before


@pytest.mark.parametrize("aux_capture, norm_output_reaches_logits", [
    ("layer_hooks", True), ("builtin", True), ("builtin", False)])
def test_the_in_server_hooks_dump_through_a_runners_copy_of_the_forward_batch(tmp_path, truth, monkeypatch,
                                                                              aux_capture, norm_output_reaches_logits,
                                                                              gc_callbacks_restored):
    """The factories' path, from ForwardBatch.init_new through the final-norm hook to the logits hook,
    on 0.5.17's layer hooks and on 0.5.23's builtin aux capture.

    SGLang cannot be imported here (its kernels need CUDA), so its two modules the hook
    touches are stood in for: a ForwardBatch dataclass and the attention-TP rank. The
    runner's copy is what 0.5.17's EagerRunner.load_batch does (``dataclasses.replace``):
    only dataclass fields survive it, which is how the live H200 run lost every dump. The final
    norm returns (normed, pre-norm sum) as SGLang's RMSNorm does; when its output is not the tensor
    the logits processor gets, the pre-norm state cannot be paired and the rids get error markers.
    """
    import dataclasses
    import enum
    import sys
    import types

    from patches import sglang_hook
    from patches.sglang_releases import FORWARD_BATCH_INFO, PARALLEL_STATE

    Mode = enum.Enum("ForwardMode", "EXTEND DECODE")

    @dataclasses.dataclass
    class ForwardBatch:
        forward_mode: Mode
        rids: list
        extend_seq_lens_cpu: list
        extend_prefix_lens_cpu: list

        @classmethod
        def init_new(cls, batch, model_runner):
            return cls(Mode.EXTEND, [r.rid for r in batch.reqs], batch.extend_lens, batch.prefix_lens)

    monkeypatch.setitem(sys.modules, FORWARD_BATCH_INFO, types.SimpleNamespace(ForwardBatch=ForwardBatch))
    monkeypatch.setitem(sys.modules, PARALLEL_STATE,
                        types.SimpleNamespace(get_attn_tensor_model_parallel_rank=lambda: 0))
    monkeypatch.setattr(sglang_hook, "_state", None)

    layer_ids, states = truth
    config = HookConfig(DumpSettings(tmp_path, "eagle3-", "tiny", tuple(layer_ids)), aux_capture=aux_capture)
    specs = {s["hook_factory"].split(":")[1]: s for s in forward_hook_specs(config)}
    logits_hook = sglang_hook.make_logits_hook(specs["make_logits_hook"]["config"])
    norm_hook = sglang_hook.make_final_norm_hook(specs["make_final_norm_hook"]["config"])
    layer_hooks = {s["config"]["layer_id"]: sglang_hook.make_aux_layer_hook(s["config"])
                   for s in forward_hook_specs(config) if s["hook_factory"] == sglang_hook.LAYER_HOOK_FACTORY}
    assert bool(layer_hooks) == (aux_capture == "layer_hooks")

    # One chunk of each prompt, "eagle3-short" whole and the first 10 tokens of "eagle3-long".
    rows = [("eagle3-short", 0, 7), ("eagle3-long", 0, 10)]
    reqs = [types.SimpleNamespace(rid=rid, origin_input_ids=PROMPTS[rid]) for rid, _, _ in rows]
    schedule_batch = types.SimpleNamespace(reqs=reqs, extend_lens=[n for *_, n in rows],
                                           prefix_lens=[p for _, p, _ in rows])
    copy = dataclasses.replace(ForwardBatch.init_new(schedule_batch, model_runner=None))

    aux, final, prenorm = (torch.cat([states[rid][k][p:p + n] for rid, p, n in rows]) for k in (0, 1, 2))
    h = final.shape[1]
    for j, layer_id in enumerate(layer_hooks):
        tap = aux[:, j * h:(j + 1) * h]
        # The layer before the tap returns (hidden_states, residual); their sum is the tap.
        layer_hooks[layer_id](None, (None, None, copy, None), (tap - 1.0, torch.ones_like(tap)))
    # model.norm(hidden_states, residual) -> (normed, hidden_states + residual)
    norm_hook(None, (prenorm - 1.0, torch.ones_like(prenorm)), (final if norm_output_reaches_logits else final.clone(),
                                                               prenorm))
    ids = torch.tensor([t for rid, p, n in rows for t in PROMPTS[rid][p:p + n]])
    builtin_aux = list(aux.split(h, dim=-1)) if aux_capture == "builtin" else None
    logits_hook(None, (ids, final, None, copy, builtin_aux), None)
    sglang_hook._state.writer.close()

    reader = DumpReader(tmp_path)
    if not norm_output_reaches_logits:
        with pytest.raises(DumpWriteFailed, match=r"no pre-norm final state.*model\.norm"):
            reader.wait("eagle3-short", len(PROMPTS["eagle3-short"]), timeout=1)
        return
    dump = reader.assemble("eagle3-short", PROMPTS["eagle3-short"])
    assert torch.allclose(dump.aux_hidden_states, states["eagle3-short"][0], atol=1e-5)
    assert torch.equal(dump.final_hidden_states, states["eagle3-short"][1])
    assert torch.equal(dump.prenorm_hidden_states, states["eagle3-short"][2])
    (piece,) = reader.pieces("eagle3-long")
    assert (piece.chunk_start, piece.chunk_len, piece.prompt_len) == (0, 10, len(PROMPTS["eagle3-long"]))
    assert not list(tmp_path.glob("*.error.json"))
