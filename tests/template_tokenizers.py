"""Small fast tokenizers carrying real chat templates and their special tokens, built locally.

Each family's template is the official Jinja text in tests/templates/ (sources: tests/templates/SOURCES.md);
the vocabulary is a byte-level BPE trained on the tiny model's corpus, plus the family's special tokens
(special=True where the model's tokenizer marks them so) and its other added tokens (``<think>``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from infra.tiny_model import CORPUS

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class Family:
    template: str                      # file name in tests/templates/
    special: tuple[str, ...]           # added tokens the model marks special
    bos: str | None = None
    eos: str | None = None
    added: tuple[str, ...] = ()        # added tokens that are not special
    extra: dict = field(default_factory=dict)


LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>")
QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

FAMILIES = {
    "llama-3.1": Family("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2": Family("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.3": Family("meta-llama-Llama-3.3-70B-Instruct.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": Family("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN, None, "<|im_end|>",
                      ("<tool_call>", "</tool_call>")),
    "qwen3": Family("Qwen-Qwen3-0.6B.jinja", QWEN, None, "<|im_end|>",
                    ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")),
    "mistral-nemo": Family("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                           ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"), "<s>", "</s>"),
    # [INST] is plain text in Mixtral's tokenizer: only <s> and </s> are special
    "mixtral": Family("mistralai-Mixtral-8x7B-Instruct-v0.1.jinja", ("<unk>", "<s>", "</s>"), "<s>", "</s>"),
    "gemma-2": Family("google-gemma-2-2b-it.jinja", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                      "<bos>", "<eos>"),
    "phi-3.5": Family("microsoft-Phi-3.5-mini-instruct.jinja",
                      ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                      "<s>", "<|endoftext|>"),
    "gpt-oss": Family("openai-gpt-oss-120b.jinja",
                      ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                       "<|end|>", "<|message|>", "<|call|>"), "<|startoftext|>", "<|return|>"),
    "lfm2.5": Family("LFM2.5-8B-A1B.jinja", ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>",
                                             "<|tool_call_end|>"), "<|startoftext|>", "<|im_end|>"),
}


@lru_cache(maxsize=1)
def _base_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return tok.to_str()


def template_text(name: str) -> str:
    return (TEMPLATES / FAMILIES[name].template).read_text(encoding="utf-8")


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A fresh tokenizer for family ``name`` with its official chat template."""
    family = FAMILIES[name]
    tok = Tokenizer.from_str(_base_json())
    tok.add_special_tokens(list(family.special))
    if family.added:
        tok.add_tokens(list(family.added))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos,
                                        chat_template=template_text(name), clean_up_tokenization_spaces=False,
                                        model_max_length=1 << 20)
    tokenizer.name_or_path = name
    return tokenizer
