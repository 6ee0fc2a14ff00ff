"""The embedded default model: deterministic, loadable offline, with a usable chat template."""

from __future__ import annotations

import hashlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.tiny_model import build_tiny_model
from patches.dumps import default_aux_layer_ids
from tests.ground_truth import reference_hidden_states


def folder_digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_gives_identical_files(tiny_model_dir, tmp_path):
    assert folder_digest(build_tiny_model(tmp_path / "again")) == folder_digest(tiny_model_dir)


def test_loads_offline_and_renders_chat(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    assert text.endswith("Paris.<|eot_id|>")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == text
    layers = default_aux_layer_ids(model.config.num_hidden_layers)
    aux, final = reference_hidden_states(model, ids, layers)
    assert aux.shape == (len(ids), 3 * model.config.hidden_size) and final.shape == (len(ids), model.config.hidden_size)
    # Random weights must still give per-position states that differ, or mix-ups would go unseen.
    assert torch.cdist(final, final).fill_diagonal_(1.0).min() > 1e-3


def test_hf_hidden_states_are_layer_inputs_and_a_post_norm_last_entry(tiny_model_dir):
    """The dump's layer convention rests on this transformers behaviour; check it on the version installed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    seen: dict[str, torch.Tensor] = {}

    def record_input(name):
        def hook(module, args, kwargs):
            seen[name] = args[0] if args else kwargs["hidden_states"]
        return hook

    def record_output(module, args, out):
        seen["last_output"] = out[0] if isinstance(out, tuple) else out

    layers = model.model.layers
    hooks = [layer.register_forward_pre_hook(record_input(f"input{i}"), with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(layers[-1].register_forward_hook(record_output))
    with torch.no_grad():
        out = model(torch.tensor([[0, 17, 99, 512, 3, 40]]), output_hidden_states=True)
        normed = model.model.norm(seen["last_output"])
    for hook in hooks:
        hook.remove()
    n = model.config.num_hidden_layers
    assert len(out.hidden_states) == n + 1
    for i in range(n):  # id i is the residual stream entering decoder layer i
        assert torch.equal(out.hidden_states[i], seen[f"input{i}"])
    assert torch.equal(out.hidden_states[n], normed) and not torch.allclose(normed, seen["last_output"])
