"""Official chat templates (tests/templates/, sources in SOURCES.md) on small tokenizers with their special tokens.

For every conversation: the ids are what the template itself gives (``apply_chat_template``), and the loss
mask equals an independent computation: each family's assistant turn written out here by hand from the
template's rules, located in the rendered text by character offsets, mapped to tokens by the offset mapping.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.chat_template import ChatTemplate, Conversation, LossMaskError, TemplateVariables
from tasks.dataset_version import ModelFacts, extraction_config
from tasks.prompts import main as prompts_main
from tasks.prompts import prepare_prompts
from tests.template_tokenizers import FAMILIES, family_tokenizer

ON, OFF = TemplateVariables(), TemplateVariables(enable_thinking=False)


@lru_cache(maxsize=None)
def tokenizer_of(family: str):
    return family_tokenizer(family)


# --------------------------------------------------------------------------- the independent mask


def _args(call: dict) -> str:
    return json.dumps(call["function"]["arguments"], ensure_ascii=False)


def _qwen_calls(calls: list[dict], content: str, qwen3: bool) -> str:
    out = []
    for j, call in enumerate(calls):
        sep = ("\n" if (j == 0 and content) or j > 0 else "") if qwen3 else "\n"
        out.append(f'{sep}<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": {_args(call)}}}\n</tool_call>')
    return "".join(out)


def _qwen3_parts(message: dict) -> tuple[str, str]:
    content = message["content"]
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], content
    if "</think>" in content:
        return (content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n"),
                content.split("</think>")[-1].lstrip("\n"))
    return "", content


def assistant_turns(family: str, messages: list[dict], variables: TemplateVariables) -> list[tuple[str, str]]:
    """(header, supervised text) of each assistant turn, as the family's template writes it."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    turns = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        last, content, calls = i == len(messages) - 1, m["content"], m.get("tool_calls")
        if family.startswith("llama"):
            body = (f'{{"name": "{calls[0]["function"]["name"]}", "parameters": {_args(calls[0])}}}' if calls
                    else content.strip())
            turns.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", body + "<|eot_id|>"))
        elif family == "qwen2.5":
            body = ((content + "\n" if content else "") + _qwen_calls(calls, content, False)[1:]) if calls else content
            turns.append(("<|im_start|>assistant\n", body + "<|im_end|>"))
        elif family == "qwen3":
            reasoning, content = _qwen3_parts(m)
            header, body = "<|im_start|>assistant\n", content
            if i > last_user and (last or reasoning):
                body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
                if not variables.enable_thinking and not reasoning.strip("\n"):
                    # the generation prompt itself writes the empty think block when thinking is off
                    header, body = header + "<think>\n\n</think>\n\n", content.lstrip("\n")
            body += _qwen_calls(calls, content, True) if calls else ""
            turns.append((header, body + "<|im_end|>"))
        elif family == "mistral-nemo":
            header = "[/TOOL_RESULTS]" if messages[i - 1]["role"] == "tool" else "[/INST]"
            body = ("[TOOL_CALLS][" + ", ".join(json.dumps(c["function"], ensure_ascii=False)[:-1]
                                               + f', "id": "{c["id"]}"}}' for c in calls) + "]") if calls else content
            turns.append((header, body + "</s>"))
        elif family == "mixtral":
            turns.append((" [/INST] ", content + "</s>"))
        elif family == "gemma-2":
            turns.append(("<start_of_turn>model\n", content.strip() + "<end_of_turn>"))
        elif family == "phi-3.5":
            turns.append(("<|assistant|>\n", content + "<|end|>"))
        elif family == "gpt-oss":
            body = (f" to=functions.{calls[0]['function']['name']}<|channel|>commentary json<|message|>"
                    f"{_args(calls[0])}<|call|>") if calls else \
                "<|channel|>final<|message|>" + content + ("<|return|>" if last else "<|end|>")
            turns.append(("<|start|>assistant", body))
        elif family == "lfm2.5":  # {% generation %} tags around content and "<|im_end|>\n"
            turns.append(("<|im_start|>assistant\n", content + "<|im_end|>\n"))
        else:
            raise AssertionError(family)
    return turns


def independent_mask(rendered: str, offsets: list[tuple[int, int]], turns: list[tuple[str, str]]) -> list[int]:
    spans, pos = [], 0
    for header, body in turns:
        at = rendered.find(header + body, pos)
        assert at >= 0, f"turn {header + body!r} not in the rendering after char {pos}:\n{rendered}"
        start = at + len(header)
        spans.append((start, start + len(body)))
        pos = start + len(body)
    return [int(any(a < end and b > start for start, end in spans)) for a, b in offsets]


def check(family: str, messages: list[dict], variables: TemplateVariables = ON, tools: list | None = None):
    """Mask ``messages`` with ``family``'s template; assert ids and mask; return the masked result."""
    tokenizer = tokenizer_of(family)
    template = ChatTemplate(tokenizer, variables)
    conversation = Conversation(messages, tools)
    masked = template.mask(conversation)
    official = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **variables.template_kwargs())
    if family == "gpt-oss":  # reads the clock through strftime_now: the template's text with today's date
        official = official.replace(datetime.now().strftime("%Y-%m-%d"), variables.date)
    rendered = template.render(conversation)
    assert rendered == official
    assert masked.input_ids == tokenizer(official, add_special_tokens=False)["input_ids"]
    offsets = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert masked.loss_mask == independent_mask(rendered, offsets, assistant_turns(family, messages, variables))
    assert masked.method == ("generation-tags" if family == "lfm2.5" else "placeholders")
    return masked


# --------------------------------------------------------------------------- conversations

SYSTEM = {"role": "system", "content": "You answer in one sentence."}
PLAIN = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "How do I boil rice?"},
     {"role": "assistant", "content": "Rinse it, add water, boil, then simmer with the lid on."},
     {"role": "user", "content": "And for how long?"},
     {"role": "assistant", "content": "About 15 minutes, then let it rest for 5.\n\n- rinse\n- simmer"}],
    # words the templates write themselves, whitespace at the ends, non-ASCII text, a trailing user turn
    [{"role": "user", "content": "Say the word assistant."},
     {"role": "assistant", "content": "assistant"},
     {"role": "user", "content": "Now something with accents."},
     {"role": "assistant", "content": " Crème brûlée, 東京, and 42 € — done. "},
     {"role": "user", "content": "Thanks!"}],
]
NO_SYSTEM = {"gemma-2"}  # its template raises 'System role not supported'
CASES = [(family, [SYSTEM] + conv if family not in NO_SYSTEM and k == 1 else conv)
         for family in FAMILIES for k, conv in enumerate(PLAIN)
         if not (family == "gpt-oss" and conv[-1]["role"] == "user")]  # gpt-oss: checked separately below


@pytest.mark.parametrize("family, messages", CASES, ids=[f"{f}-{i % len(PLAIN)}" for i, (f, _) in enumerate(CASES)])
def test_official_template_ids_and_mask(family, messages):
    check(family, messages)


QWEN3_REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is four.", "reasoning_content": "\nTwo and two make four.\n"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six.", "reasoning_content": "Three and three make six."}]
QWEN3_INLINE = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\nIt is four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "<think>\nThree and three make six.\n</think>\n\nSix."}]


@pytest.mark.parametrize("messages", [QWEN3_REASONING, QWEN3_INLINE], ids=["reasoning_content", "inline-think"])
@pytest.mark.parametrize("variables", [ON, OFF], ids=["thinking-on", "thinking-off"])
def test_qwen3_multi_turn_reasoning(messages, variables):
    template = ChatTemplate(tokenizer_of("qwen3"), variables)
    whole = template.render(Conversation(messages))
    # Qwen3 renders the first turn without its reasoning once a later user turn exists: prefixes of the
    # conversation are not prefixes of its rendering (the old prefix method rejected every such row).
    assert not whole.startswith(template.render(Conversation(messages[:2])))
    assert "Two and two" not in whole and "<think>\nThree and three make six.\n</think>\n\nSix." in whole
    masked = check("qwen3", messages, variables)
    tokenizer = tokenizer_of("qwen3")
    supervised = tokenizer.decode([t for t, bit in zip(masked.input_ids, masked.loss_mask) if bit])
    assert supervised == "It is four.<|im_end|><think>\nThree and three make six.\n</think>\n\nSix.<|im_end|>"


def test_enable_thinking_decides_whether_the_empty_think_block_is_supervised():
    tokenizer = tokenizer_of("qwen3")
    on, off = check("qwen3", PLAIN[0], ON), check("qwen3", PLAIN[0], OFF)
    assert on.input_ids == off.input_ids  # same text: the last turn always holds a think block
    decode = lambda m: tokenizer.decode([t for t, bit in zip(m.input_ids, m.loss_mask) if bit])  # noqa: E731
    assert decode(on) == "<think>\n\n</think>\n\nThe capital of France is Paris.<|im_end|>"
    assert decode(off) == "The capital of France is Paris.<|im_end|>"


def test_gpt_oss_trailing_user_and_earlier_turns():
    check("gpt-oss", PLAIN[1])
    check("gpt-oss", [SYSTEM] + PLAIN[1])


# --------------------------------------------------------------------------- the date


@pytest.mark.parametrize("family, written", [("llama-3.2", "Today Date: {:%d %b %Y}"),
                                             ("llama-3.1", "Today Date: {:%d %b %Y}"),
                                             ("gpt-oss", "Current date: {:%Y-%m-%d}")])
def test_the_date_a_template_writes_is_a_fixed_variable_not_today(family, written):
    tokenizer = tokenizer_of(family)
    messages = PLAIN[0]
    fixed = ChatTemplate(tokenizer).render(Conversation(messages))
    assert written.format(datetime(2024, 7, 26)) in fixed
    later = ChatTemplate(tokenizer, TemplateVariables(date="2025-03-09"))
    assert written.format(datetime(2025, 3, 9)) in later.render(Conversation(messages))
    assert later.mask(Conversation(messages)).input_ids != ChatTemplate(tokenizer).mask(Conversation(messages)).input_ids
    if family != "llama-3.1":  # 3.2 and gpt-oss read the clock when nothing fixes the date
        assert written.format(datetime.now()) in tokenizer.apply_chat_template(messages, tokenize=False)


def test_template_variables_are_part_of_the_version():
    model = ModelFacts("m", 8, 64, 1024, "identity")

    def fingerprint(variables: TemplateVariables) -> str:
        return extraction_config(model, None, "float32", "t" * 32, 2048, "truncate",
                                 template_variables=variables.record()).fingerprint()

    base = fingerprint(TemplateVariables())
    assert base == fingerprint(TemplateVariables(date="2024-07-26", enable_thinking=True))
    assert len({base, fingerprint(TemplateVariables(date="2024-07-27")), fingerprint(OFF),
                fingerprint(TemplateVariables(chat_template_kwargs={"reasoning_effort": "high"}))}) == 4
    with pytest.raises(ValueError, match="ISO date"):
        TemplateVariables(date="26 Jul 2024")
    with pytest.raises(ValueError, match="date_string"):
        TemplateVariables(chat_template_kwargs={"date_string": "today"})


def test_template_variables_are_flow_parameters_with_fixed_defaults():
    from pydantic import ValidationError

    from flows.extract import parse_args
    from flows.parameters import ExtractParameters

    assert parse_args([]).template_variables() == TemplateVariables()
    given = parse_args(["--template-date", "2025-01-02", "--no-enable-thinking",
                        "--chat-template-kwargs", '{"reasoning_effort": "high"}']).template_variables()
    assert given.record() == {"date": "2025-01-02", "enable_thinking": False,
                              "chat_template_kwargs": {"reasoning_effort": "high"}}
    with pytest.raises(ValidationError, match="template_date"):
        ExtractParameters(template_date="today")


# --------------------------------------------------------------------------- tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call00001"},
              {"role": "assistant", "content": "It is 21 °C in Paris."}]
TOOL_TURNS_WITH_TEXT = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": "Let me check."}] + TOOL_TURNS[2:]
TOOL_FAMILIES = ["llama-3.1", "llama-3.2", "llama-3.3", "qwen2.5", "qwen3", "mistral-nemo", "gpt-oss"]


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_tool_calls_supervised_tool_results_not(family):
    masked = check(family, TOOL_TURNS, tools=TOOLS)
    tokenizer = tokenizer_of(family)
    supervised = tokenizer.decode([t for t, bit in zip(masked.input_ids, masked.loss_mask) if bit])
    assert "get_weather" in supervised and "Paris" in supervised and "temp_c" not in supervised
    if family.startswith("qwen"):
        check(family, TOOL_TURNS_WITH_TEXT, tools=TOOLS)


def test_qwen3_agentic_turns_keep_their_reasoning_after_the_last_user_turn():
    # After the last user turn every assistant turn with reasoning shows it (tool calls included);
    # before it, reasoning is dropped.
    messages = [QWEN3_REASONING[0], QWEN3_REASONING[1], {"role": "user", "content": "Weather in Paris?"},
                {**TOOL_TURNS[1], "reasoning_content": "I should call the weather tool."}, TOOL_TURNS[2],
                {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "The tool says 21."}]
    for variables in (ON, OFF):
        masked = check("qwen3", messages, variables, tools=TOOLS)
        tokenizer = tokenizer_of("qwen3")
        supervised = tokenizer.decode([t for t, bit in zip(masked.input_ids, masked.loss_mask) if bit])
        assert "Two and two" not in supervised and "I should call the weather tool." in supervised
        assert "The tool says 21." in supervised and "temp_c" not in supervised


def test_tool_call_that_no_method_can_place_is_rejected_with_the_reason():
    # Mistral Nemo has no generation prompt: an answer follows "[/INST]" or "[/TOOL_RESULTS]" directly, so a
    # turn of tool calls right after a tool result has nothing that marks where it starts.
    second = {"type": "function", "id": "call00002", "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}
    messages = TOOL_TURNS[:3] + [{"role": "assistant", "content": "", "tool_calls": [second]},
                                 {"role": "tool", "content": '{"temp_c": 23}', "tool_call_id": "call00002"},
                                 {"role": "assistant", "content": "Paris 21 °C, Nice 23 °C."}]
    with pytest.raises(LossMaskError, match="message 3 \\(assistant\\) is only tool calls, and the chat template's "
                                            "generation prompt '' does not open its turn"):
        ChatTemplate(tokenizer_of("mistral-nemo")).mask(Conversation(messages, TOOLS))
    check("qwen2.5", messages, tools=TOOLS)  # a template with a generation prompt places it


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_openai_and_sharegpt_tool_rows_are_rendered_masked_and_counted(tmp_path):
    sharegpt = [{"from": "human", "value": "Weather in Rome?"},
                {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})},
                {"from": "observation", "value": '{"temp_c": 25}'},
                {"from": "gpt", "value": "It is 25 °C in Rome."}]
    path = write_jsonl(tmp_path / "tools.jsonl", [
        {"id": "openai", "messages": TOOL_TURNS, "tools": TOOLS},
        {"id": "sharegpt", "conversations": sharegpt, "tools": TOOLS},
        {"id": "two-calls", "messages": [TOOL_TURNS[0], {"role": "assistant", "content": "",
                                                          "tool_calls": [CALL, CALL]}]},
        {"id": "bad-args", "messages": [TOOL_TURNS[0], {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{city: Rome"}}]}]},
    ])
    result = prepare_prompts(path, tokenizer_of("llama-3.1"))
    assert [s.source_id for s in result.samples] == ["openai", "sharegpt"]
    assert (result.tool_calls, result.tool_results) == (2, 2)
    reasons = {r.source_id: r.reason for r in result.rejected}
    assert reasons["two-calls"] == ("chat template refused the conversation: This model only supports single "
                                    "tool-calls at once!")
    assert reasons["bad-args"].startswith("malformed row: the arguments of tool call 'get_weather' in message 1 "
                                          "are not JSON")
    sample = result.samples[1]
    sharegpt_messages = [sharegpt[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": '{"temp_c": 25}'}, {"role": "assistant", "content": sharegpt[3]["value"]}]
    sharegpt_messages[0] = {"role": "user", "content": sharegpt[0]["value"]}
    masked = check("llama-3.1", sharegpt_messages, tools=TOOLS)
    assert (sample.input_ids, sample.loss_mask) == (masked.input_ids, masked.loss_mask)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("family, messages, message", [
    ("gemma-2", [SYSTEM] + PLAIN[0], "System role not supported"),
    ("gemma-2", [PLAIN[0][0], PLAIN[0][0], PLAIN[0][1]],
     "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("mistral-nemo", [PLAIN[0][0], PLAIN[0][0], PLAIN[0][1]],
     "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."),
    ("mixtral", [TOOL_TURNS[0], TOOL_TURNS[2], PLAIN[0][1]],
     "Only user and assistant roles are supported, with the exception of an initial optional system message!"),
])
def test_a_conversation_the_template_refuses_is_rejected_with_its_message(tmp_path, family, messages, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "refused", "messages": messages},
                                             {"id": "fine", "messages": PLAIN[0]}])
    result = prepare_prompts(path, tokenizer_of(family))
    assert [s.source_id for s in result.samples] == ["fine"]
    assert [(r.source_id, r.reason) for r in result.rejected] == [
        ("refused", f"chat template refused the conversation: {message}")]


# --------------------------------------------------------------------------- any conversation

text = st.builds(lambda head, tail: head + tail,
                 st.sampled_from(["a", "Z", "7", "#", "é", "東", "assistant", "user:", " lead", "\nnl"]),
                 st.text(alphabet=st.sampled_from(list("abc XYZ019.,;:!?-_'\"\n\té東€")), max_size=30))


@st.composite
def conversations(draw):
    messages = []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(text.filter(str.strip))})
        messages.append({"role": "assistant", "content": draw(text.filter(str.strip))})
    return messages


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
@pytest.mark.parametrize("family", ["llama-3.2", "qwen2.5", "qwen3", "mistral-nemo", "mixtral", "gemma-2", "phi-3.5",
                                    "lfm2.5"])
def test_mask_property_any_conversation(family, messages):
    check(family, messages)


@st.composite
def reasoning_conversations(draw):
    messages = []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(text.filter(str.strip))})
        reasoning, content = draw(text.filter(str.strip)), draw(text.filter(str.strip))
        shape = draw(st.sampled_from(["plain", "field", "inline"]))
        if shape == "field":
            messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})
        elif shape == "inline":
            messages.append({"role": "assistant", "content": f"<think>{reasoning}</think>{content}"})
        else:
            messages.append({"role": "assistant", "content": content})
    return messages


@settings(max_examples=40, deadline=None)
@given(messages=reasoning_conversations(), thinking=st.booleans())
def test_qwen3_mask_property_any_reasoning_conversation(messages, thinking):
    check("qwen3", messages, TemplateVariables(enable_thinking=thinking))


# --------------------------------------------------------------------------- checking a new template by eye


def test_show_prints_one_conversation_with_its_mask(tmp_path, capsys):
    model = tmp_path / "model"
    tokenizer_of("qwen3").save_pretrained(model)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": PLAIN[0]},
                                                 {"id": "b", "messages": QWEN3_REASONING},
                                                 {"id": "c", "messages": [{"role": "user", "content": "Hi"}]}])
    base = ["show", "--model-path", str(model), "--prompts", str(prompts)]
    assert prompts_main(base + ["--row", "2", "--colour", "never"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("line 2 (b): ")
    assert "<|im_start|>assistant\n[[It is four.<|im_end|>]]\n<|im_start|>user" in out
    assert "[[<think>\nThree and three make six.\n</think>\n\nSix.<|im_end|>]]" in out

    assert prompts_main(base + ["--row", "1", "--colour", "always", "--no-enable-thinking"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[1;30;42mThe capital of France is Paris.<|im_end|>\x1b[0m" in out
    assert '"enable_thinking": false' in out

    assert prompts_main(base + ["--row", "3"]) == 1
    assert capsys.readouterr().out == "line 3 (c): rejected: no assistant turn\n"
