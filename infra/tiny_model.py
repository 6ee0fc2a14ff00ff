"""A tiny, deterministic Llama for demos and tests: ``python -m infra.tiny_model OUT_DIR``.

Random weights from a fixed seed, a byte-level BPE tokenizer trained on the small
English corpus below, and a Llama-3-style chat template (no ``{% generation %}``
tags, as most real templates). The folder loads offline with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``; the
same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, START_HEADER, END_HEADER, EOT]
VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Enough varied English for a BPE of ~1000 merges; fixed text, so training is deterministic.
CORPUS = """\
The capital city of France is Paris. The capital city of Italy is Rome. The capital of Japan is Tokyo.
A user asks a question and the assistant answers it clearly, briefly and politely.
You are a helpful assistant. Please explain how a draft model speeds up speculative decoding.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
Write a short poem about the sea, the wind, the stars and the long road home.
What is the sum of two and three? The answer is five. What is ten minus four? It is six.
Machine learning models learn patterns from data; larger models often need more data and compute.
The server reads the request, runs the model forward, and writes the hidden states to disk.
Once upon a time there was a little village near a river, where people farmed and fished.
Summarise the following paragraph in one sentence, keeping the key facts and names.
Python is a programming language. def main(): print("hello, world") return 0
Translate to French: good morning, thank you, see you tomorrow, the weather is nice today.
The history of science is full of surprising discoveries, careful experiments and bold ideas.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.
Questions and answers: who, what, when, where, why, how? Because it works, and it is simple.
The train leaves the station at nine in the morning and arrives in the city before noon.
Cooking rice: rinse the grains, add water, bring to a boil, then simmer with the lid on.
Good software is tested, documented and easy to change; bad software surprises its users.
Mountains, forests, lakes and valleys: the northern landscape changes colour with every season.
Doctors recommend sleeping eight hours, drinking water, walking daily and eating vegetables.
The library opens at eight o'clock; students borrow books about physics, chemistry and biology.
Explain recursion: a function that calls itself with a smaller problem until a base case stops it.
Yesterday the orchestra played a symphony; the violins, trumpets and drums filled the theatre.
An economy grows when businesses invest, workers are productive and markets remain competitive.
Please list three benefits of exercise, then describe one disadvantage of working too late.
Gardening tips: plant tomatoes after the frost, water them regularly and support the stems.
The spacecraft orbited the planet, photographed its moons and transmitted the images back.
JSON example: {"name": "Alice", "age": 30, "languages": ["English", "Spanish", "German"]}
Every morning she jogged along the beach, listening to seagulls and watching fishing boats.
Compare the advantages of trains, buses, bicycles and cars for commuting inside crowded cities.
Democracy depends on elections, free newspapers, independent courts and informed citizens.
Chemistry: water is hydrogen and oxygen; salt is sodium and chlorine; carbon forms diamonds.
Keyboard, mouse, monitor, printer, laptop, network, database, algorithm, compiler, variable.
"""


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Many copies so that merges reach the vocabulary size; line order fixed, so the result is too.
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Prepend BOS on plain encodes, as Llama-3's tokenizer does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=EOT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out_dir: Path | str, *, layers: int = 8, hidden: int = 64, seed: int = 0,
                     intermediate: int | None = None, heads: int = 4, kv_heads: int = 2,
                     device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Write the tiny model and tokenizer to ``out_dir``; returns it.

    With ``hidden=4096, intermediate=14336, heads=32, kv_heads=8`` and ``device="cuda"``,
    ``dtype=torch.bfloat16`` it is a random model of Llama-3-8B's width (built on the GPU in
    seconds) for measuring at real load; the weights then depend on the device's generator.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    # The default init (std 0.02) leaves a random tiny model's hidden states nearly constant
    # across positions; a larger spread makes per-token states differ, so tests catch mix-ups.
    with torch.no_grad():
        generator = torch.Generator(device).manual_seed(seed)
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * (1.0 / param.shape[-1] ** 0.5))
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    out = build_tiny_model(args.out_dir, layers=args.layers, hidden=args.hidden, seed=args.seed,
                           intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
                           device=args.device, dtype=getattr(torch, args.dtype))
    print(out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
