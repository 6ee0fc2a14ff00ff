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
