"""Prompt preparation with the tiny model's real tokenizer: masks, shapes, formats, rejects, duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tasks.chat_template import ChatTemplate, ChatTemplateMissing, Conversation, template_hash
from tasks.prompts import (PromptFileError, normalize_conversation, prepare_prompts, read_conversations, sample_key,
                           write_rejects)

DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "demo_prompts.jsonl"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The shape of Meta's Llama-3 template: content trimmed, a default system prompt.
TRIMMING_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou are a helpful assistant.<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# A turn closed by plain text, no special end-of-turn token.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize + ': ' + message['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "How do I boil rice?"},
     {"role": "assistant", "content": "Rinse it, add water, boil, then simmer with the lid on."},
     {"role": "user", "content": "And for how long?"},
     {"role": "assistant", "content": "About 15 minutes, then let it rest for 5.\n\n- rinse\n- simmer"}],
    # Content equal to header text, leading space, unicode, a trailing user turn.
    [{"role": "user", "content": "Say the word assistant."},
     {"role": "assistant", "content": "assistant"},
     {"role": "user", "content": "Now something with accents."},
     {"role": "assistant", "content": " Crème brûlée, 東京, and 42 € — done."},
     {"role": "user", "content": "Thanks!"}],
    # The assistant speaks first.
    [{"role": "assistant", "content": "Hi! What would you like to cook today?"},
     {"role": "user", "content": "Soup."},
     {"role": "assistant", "content": "Lentil soup it is."}],
]


def tokenizer_with(model_dir: Path, template: str | None = None, extra_special: list[str] | None = None):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if extra_special:
        tokenizer.add_tokens(extra_special, special_tokens=True)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return tokenizer_with(tiny_model_dir)


@pytest.fixture(scope="session")
def chatml_tokenizer(tiny_model_dir):
    return tokenizer_with(tiny_model_dir, CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"])


def compute_loss_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    masked = ChatTemplate(tokenizer).mask(Conversation(messages))
    return masked.input_ids, masked.loss_mask


def supervised_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of masked tokens: the independent view of the mask."""
    runs, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def assistant_texts(messages: list[dict], closing: str, strip: bool = False) -> list[str]:
    return [(m["content"].strip() if strip else m["content"]) + closing for m in messages if m["role"] == "assistant"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_mask_covers_exactly_assistant_content_and_eot(tokenizer, messages):
    ids, mask = compute_loss_mask(tokenizer, messages)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert len(mask) == len(ids)
    assert supervised_runs(tokenizer, ids, mask) == assistant_texts(messages, "<|eot_id|>")
    # Everything else is the template's and the other roles' text.
    unmasked = tokenizer.decode([t for t, bit in zip(ids, mask) if not bit])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked


# Content that starts with a non-space (leading whitespace can share a token with the header's "\n\n"),
# from an alphabet with newlines, punctuation, non-ASCII text and words the template itself writes.
content_text = st.builds(lambda head, tail: head + tail,
                         st.sampled_from(["a", "Z", "7", "#", "é", "東", "assistant", "<|eot_id|>", "user:"]),
                         st.text(alphabet=st.sampled_from(list("abc XYZ019.,;:!?-_'\"\n\té東€")), max_size=40))


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(content_text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(content_text)})
        messages.append({"role": "assistant", "content": draw(content_text)})
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(content_text)})
    return messages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_mask_property_any_conversation(tokenizer, chatml_tokenizer, messages):
    for tok, closing in ((tokenizer, "<|eot_id|>"), (chatml_tokenizer, "<|im_end|>")):
        ids, mask = compute_loss_mask(tok, messages)
        assert supervised_runs(tok, ids, mask) == assistant_texts(messages, closing)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_mask_with_chatml_template(chatml_tokenizer, messages):
    ids, mask = compute_loss_mask(chatml_tokenizer, messages)
    assert chatml_tokenizer.decode(ids).startswith("<|im_start|>")
    assert supervised_runs(chatml_tokenizer, ids, mask) == assistant_texts(messages, "<|im_end|>")


def test_mask_with_trimming_template_and_default_system_prompt(tiny_model_dir):
    tokenizer = tokenizer_with(tiny_model_dir, TRIMMING_TEMPLATE)
    messages = [{"role": "user", "content": "  Is water wet?  "},
                {"role": "assistant", "content": "\n  It makes other things wet.  \n"},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "Glad to help. "}]
    ids, mask = compute_loss_mask(tokenizer, messages)
    assert "You are a helpful assistant." in tokenizer.decode([t for t, b in zip(ids, mask) if not b])
    assert supervised_runs(tokenizer, ids, mask) == assistant_texts(messages, "<|eot_id|>", strip=True)


def test_mask_without_special_end_of_turn_supervises_content_only(tiny_model_dir):
    tokenizer = tokenizer_with(tiny_model_dir, PLAIN_TEMPLATE)
    messages = CONVERSATIONS[1]
    ids, mask = compute_loss_mask(tokenizer, messages)
    assert supervised_runs(tokenizer, ids, mask) == assistant_texts(messages, "")


@pytest.mark.parametrize("rewrite, reason", [
    ("upper", "loss mask: the chat template writes this conversation differently when its messages' text is "
              "replaced by placeholders (it inspects or rewrites the text), so the text cannot be located"),
    ("replace('.', '!')", "loss mask: the content of message 1 (assistant) does not appear in the rendered "
                          "conversation as written or with its ends stripped; the template rewrites it"),
])
def test_template_that_rewrites_content_is_a_reject_not_a_wrong_mask(tiny_model_dir, tmp_path, rewrite, reason):
    template = CHATML_TEMPLATE.replace("message['content']", f"message['content'] | {rewrite}")
    tokenizer = tokenizer_with(tiny_model_dir, template, ["<|im_start|>", "<|im_end|>"])
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": CONVERSATIONS[0]}])
    result = prepare_prompts(path, tokenizer)
    assert result.samples == []
    assert [(r.source_id, r.reason) for r in result.rejected] == [("a", reason)]


def test_template_that_only_writes_assistant_text_gives_all_ones_reject(tiny_model_dir, tmp_path):
    tokenizer = tokenizer_with(tiny_model_dir, "{% for m in messages %}{% if m.role == 'assistant' %}"
                                               "{{ m.content }}{% endif %}{% endfor %}")
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": CONVERSATIONS[0]}])
    (reject,) = prepare_prompts(path, tokenizer).rejected
    assert reject.reason == "loss mask: loss mask is all ones: the template wrote nothing but assistant content"


def test_template_error_is_a_reject(tiny_model_dir, tmp_path):
    strict = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
              "{{ m.role + ': ' + m.content + '<|eot_id|>' }}{% endfor %}")
    tokenizer = tokenizer_with(tiny_model_dir, strict)
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "ok", "messages": CONVERSATIONS[0]},
                                              {"id": "bad", "messages": CONVERSATIONS[1]}])
    result = prepare_prompts(path, tokenizer)
    assert [s.source_id for s in result.samples] == ["ok"]
    assert result.rejected[0].reason == "chat template refused the conversation: roles must alternate user/assistant"


def test_tokenizer_without_template_fails_naming_it(tiny_model_dir, tmp_path):
    tokenizer = tokenizer_with(tiny_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateMissing, match="tiny_model"):
        prepare_prompts(write_jsonl(tmp_path / "p.jsonl", []), tokenizer)


# --------------------------------------------------------------------------- shapes, formats, limits


def test_sharegpt_and_openai_shapes_give_the_same_sample(tokenizer, tmp_path):
    sharegpt = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                for m in CONVERSATIONS[1]]
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "oa", "messages": CONVERSATIONS[1]},
                                              {"id": "sg", "conversations": sharegpt}])
    result = prepare_prompts(path, tokenizer)
    assert [s.source_id for s in result.samples] == ["oa"]
    (dup,) = result.duplicates
    assert (dup.source_id, dup.first_source_id, dup.line) == ("sg", "oa", 2)


def test_three_file_formats_read_the_same_rows(tokenizer, tmp_path):
    rows = [{"id": f"r{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)]
    rows.append({"id": "sg", "conversations": [{"from": "human", "value": "Name a prime."},
                                               {"from": "gpt", "value": "Seven is prime."}]})
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    as_json = tmp_path / "p.json"
    as_json.write_text(json.dumps(rows), encoding="utf-8")
    parquet = tmp_path / "p.parquet"
    pl.DataFrame([{"id": r["id"], "messages": r.get("messages"), "conversations": r.get("conversations")}
                  for r in rows]).write_parquet(parquet)
    results = [prepare_prompts(p, tokenizer) for p in (jsonl, as_json, parquet)]
    for result in results:
        assert result.rows_in == len(rows) and not result.rejected and not result.duplicates
        assert [s.source_id for s in result.samples] == [r["id"] for r in rows]
        assert [s.line for s in result.samples] == list(range(1, len(rows) + 1))
    assert [s.sample_key for s in results[0].samples] == [s.sample_key for s in results[2].samples]
    assert results[0].samples == results[1].samples


def test_rows_without_id_are_named_by_line(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": CONVERSATIONS[0]}, "", {"messages": CONVERSATIONS[1]}])
    result = prepare_prompts(path, tokenizer)
    # The blank line is not a row, but line numbers stay those of the file.
    assert result.rows_in == 2
    assert [(s.source_id, s.line) for s in result.samples] == [("line-1", 1), ("line-3", 3)]


def test_truncate_keeps_the_prefix_and_skip_rejects(tokenizer, tmp_path):
    messages = CONVERSATIONS[1]
    full_ids, full_mask = compute_loss_mask(tokenizer, messages)
    first_supervised = full_mask.index(1)
    limit = first_supervised + 3
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "long", "messages": messages},
                                              {"id": "short", "messages": CONVERSATIONS[0]}])
    short_len = len(compute_loss_mask(tokenizer, CONVERSATIONS[0])[0])
    assert short_len <= limit < len(full_ids)

    truncated = prepare_prompts(path, tokenizer, max_length=limit)
    long_sample, short_sample = truncated.samples
    assert long_sample.truncated and not short_sample.truncated
    assert long_sample.input_ids == full_ids[:limit] and long_sample.loss_mask == full_mask[:limit]
    assert sum(long_sample.loss_mask) == 3
    assert long_sample.sample_key == sample_key(full_ids[:limit], full_mask[:limit])

    skipped = prepare_prompts(path, tokenizer, max_length=limit, on_overlong="skip")
    assert [s.source_id for s in skipped.samples] == ["short"]
    (reject,) = skipped.rejected
    assert reject == type(reject)(1, "long", f"too long: {len(full_ids)} tokens > max_length {limit} "
                                             f"(on_overlong=skip)")

    nothing_left = prepare_prompts(path, tokenizer, max_length=first_supervised)
    assert nothing_left.rejected[0].reason.startswith("nothing supervised after truncation")


def test_bad_arguments_and_files(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ValueError, match="on_overlong"):
        prepare_prompts(path, tokenizer, on_overlong="drop")
    (tmp_path / "p.csv").write_text("id,text\n")
    with pytest.raises(PromptFileError, match="unknown format '.csv'"):
        list(read_conversations(tmp_path / "p.csv"))
    (tmp_path / "obj.json").write_text('{"messages": []}')
    with pytest.raises(PromptFileError, match="obj.json: a .json prompt file holds a list of rows, not a dict"):
        list(read_conversations(tmp_path / "obj.json"))
    with pytest.raises(PromptFileError, match="no such file"):
        list(read_conversations(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- rejects, duplicates, accounting


def test_every_reject_reason_duplicates_and_counts(tokenizer, tmp_path):
    good = CONVERSATIONS[0]
    rows = [
        {"id": "good", "messages": good},                                           # 1
        '{"id": "broken", "messages": [',                                           # 2
        "[1, 2]",                                                                   # 3
        {"id": "tool", "messages": [{"role": "ipython", "content": "42"}, good[1]]},  # 4
        {"id": "sg-role", "conversations": [{"from": "bot", "value": "hi"}]},       # 5
        {"id": "no-asst", "messages": [good[0]]},                                   # 6
        {"id": "empty", "messages": [good[0], {"role": "assistant", "content": "  "}]},  # 7
        {"id": "nonstr", "messages": [good[0], {"role": "assistant", "content": None}]},  # 8
        {"id": "neither", "text": "hello"},                                          # 9
        {"id": "both", "messages": good, "conversations": good},                    # 10
        {"id": "nolist", "messages": []},                                           # 11
        {"id": "copy-of-good", "messages": good},                                   # 12
        {"id": "good", "messages": CONVERSATIONS[1]},                               # 13
        {"id": "good", "messages": good},                                           # 14
        {"id": "other", "messages": CONVERSATIONS[2]},                              # 15
    ]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    result = prepare_prompts(path, tokenizer)
    assert result.rows_in == 15
    assert [(s.source_id, s.line) for s in result.samples] == [("good", 1), ("other", 15)]
    assert [(d.line, d.source_id, d.first_source_id) for d in result.duplicates] == [
        (12, "copy-of-good", "good"), (14, "good", "good")]
    assert all(d.sample_key == result.samples[0].sample_key for d in result.duplicates)
    reasons = {(r.line, r.source_id): r.reason for r in result.rejected}
    assert list(reasons) == [(2, None), (3, None), (4, "tool"), (5, "sg-role"), (6, "no-asst"), (7, "empty"),
                             (8, "nonstr"), (9, "neither"), (10, "both"), (11, "nolist"), (13, "good")]
    assert reasons[(2, None)].startswith("malformed row: bad JSON")
    assert reasons[(3, None)] == "malformed row: a row is a JSON object, not a list"
    assert reasons[(4, "tool")] == "unknown role 'ipython' in message 0; known: assistant, system, tool, user"
    assert reasons[(5, "sg-role")].startswith("unknown role 'bot' in message 0; known: assistant, chatgpt, "
                                              "function_call, gpt")
    assert reasons[(6, "no-asst")] == "no assistant turn"
    assert reasons[(7, "empty")] == "empty content in message 1 (assistant)"
    assert reasons[(8, "nonstr")] == "malformed row: content of message 1 is a NoneType, not a string"
    assert reasons[(9, "neither")] == "malformed row: no 'messages' or 'conversations' field"
    assert reasons[(10, "both")] == "malformed row: has both 'messages' and 'conversations'"
    assert reasons[(11, "nolist")] == "malformed row: 'messages' is not a non-empty list"
    assert reasons[(13, "good")] == ("duplicate id: 'good' already names the different conversation on line 1")
    assert result.rows_in == len(result.samples) + len(result.duplicates) + len(result.rejected)

    rejects_file = write_rejects(tmp_path / "out" / "rejects.jsonl", result.rejected)
    written = [json.loads(line) for line in rejects_file.read_text().splitlines()]
    assert [(w["line"], w["source_id"], w["reason"]) for w in written] == [
        (r.line, r.source_id, r.reason) for r in result.rejected]
    assert write_rejects(tmp_path / "none.jsonl", []).read_text() == ""


def test_sample_key_covers_ids_and_mask():
    assert sample_key([1, 2, 3], [0, 1, 1]) == sample_key([1, 2, 3], [0, 1, 1])
    assert sample_key([1, 2, 3], [0, 1, 1]) != sample_key([1, 2, 3], [0, 0, 1])
    assert sample_key([1, 2, 3], [0, 1, 1]) != sample_key([1, 2, 4], [0, 1, 1])
    with pytest.raises(ValueError):
        sample_key([1, 2], [1])


def test_template_hash_follows_the_template(tokenizer, chatml_tokenizer, tiny_model_dir):
    assert template_hash(tokenizer) == template_hash(tokenizer_with(tiny_model_dir))
    assert template_hash(tokenizer) != template_hash(chatml_tokenizer)


# --------------------------------------------------------------------------- the demo file


def test_demo_prompts(tokenizer):
    assert DEMO_PROMPTS.stat().st_size < 300_000
    rows = [row for _, row in read_conversations(DEMO_PROMPTS)]
    assert len(rows) >= 110 and all(isinstance(r, dict) and r.get("id") for r in rows)
    shapes = {"messages" if "messages" in r else "conversations" for r in rows}
    assert shapes == {"messages", "conversations"}
    assert any(r.get("messages", [{}])[0].get("role") == "system" for r in rows)

    result = prepare_prompts(DEMO_PROMPTS, tokenizer, max_length=2048)
    assert {r.source_id: r.reason.split(" in message")[0] for r in result.rejected} == {
        "demo-reject-no-assistant": "no assistant turn",
        "demo-reject-unknown-role": "unknown role 'function'",
    }
    assert [(d.source_id, d.first_source_id) for d in result.duplicates] == [("demo-dup-of-007", "demo-007")]
    assert len(result.samples) == len(rows) - 3 and result.rows_in == len(rows)
    lengths = sorted(len(s.input_ids) for s in result.samples)
    assert lengths[0] < 64 and lengths[-1] > 400
    messages_by_id = {r["id"]: normalize_conversation(r).messages for r in rows if r["id"][5:].isdigit()}
    for sample in result.samples:
        assert supervised_runs(tokenizer, sample.input_ids, sample.loss_mask) == assistant_texts(
            messages_by_id[sample.source_id], "<|eot_id|>")


def test_a_folder_or_glob_of_files_is_one_source_that_grows(tokenizer, tmp_path):
    """The nightly source: files read in name order, ids without an id field kept apart per file,
    the same content in two files a duplicate, and a file added later adds only its rows."""
    folder = tmp_path / "prompts"
    (folder / "b").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"messages": CONVERSATIONS[0]}, {"id": "x", "messages": CONVERSATIONS[1]}])
    write_jsonl(folder / "b" / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    (folder / "notes.txt").write_text("not prompts")
    first = prepare_prompts(folder, tokenizer)
    assert [s.source_id for s in first.samples] == ["a.jsonl:line-1", "x"]
    assert [(d.source_id, d.first_source_id) for d in first.duplicates] == [("b/c.jsonl:line-1", "a.jsonl:line-1")]
    assert first.rows_in == 3

    write_jsonl(folder / "d.jsonl", [{"messages": CONVERSATIONS[2]}])
    grown = prepare_prompts(folder, tokenizer)
    assert [s.source_id for s in grown.samples] == ["a.jsonl:line-1", "x", "d.jsonl:line-1"]
    assert [s.sample_key for s in grown.samples[:2]] == [s.sample_key for s in first.samples]

    globbed = prepare_prompts(f"{folder}/*.jsonl", tokenizer)
    assert [s.source_id for s in globbed.samples] == ["a.jsonl:line-1", "x", "d.jsonl:line-1"]
    with pytest.raises(PromptFileError, match="the glob matches no file"):
        prepare_prompts(f"{folder}/*.parquet", tokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptFileError, match="holds no .jsonl, .json, .parquet files"):
        prepare_prompts(tmp_path / "empty", tokenizer)
