"""A model's chat template, rendered deterministically, and the loss masks of what it renders.

Template variables
    Besides the messages a template reads variables, and three kinds change the ids of a training set:
    the date (Llama 3.2 writes "Today Date: <today>" into its system header through ``strftime_now``
    unless ``date_string`` is given; gpt-oss writes "Current date: <today>" through ``strftime_now``),
    ``enable_thinking`` (Qwen3's generation prompt), and whatever else a user passes
    (``chat_template_kwargs``). :class:`TemplateVariables` fixes them for a dataset version, with stated
    defaults, so the same rows give the same ids on every night; they are recorded in ``dataset.json``
    and in the version fingerprint (a changed value is a new version).

Rendering
    transformers' own sandboxed Jinja environment for chat templates (``raise_exception``, ``tojson``,
    ``{% generation %}``), called with ``strftime_now`` answering the fixed date instead of the clock.
    Apart from that clock, the text is what ``tokenizer.apply_chat_template(messages, tools=...,
    **variables)`` gives (tests/test_chat_templates.py checks it on real templates); the ids are that
    text tokenized without added special tokens (the template writes them).

Loss mask (SpecForge's convention)
    1 on what the model writes in each assistant turn: from the end of the template's generation
    prompt (e.g. ``<|im_start|>assistant\\n``) through the assistant's text (reasoning, content, tool
    calls) and the end-of-turn token that closes it (``<|eot_id|>``, ``<|im_end|>``, ``</s>``,
    ``<end_of_turn>``); 0 on everything else (system, user and tool-result turns, headers). Two methods:

    * ``{% generation %}`` tags, where the template has them: transformers' assistant-token mask,
      i.e. exactly the text the template tags.
    * Otherwise, placeholders: the whole conversation is rendered once as it is and once with every
      message's text (content, reasoning; a ``<think>`` block inside content stays a ``<think>`` block)
      replaced by a unique placeholder. The placeholders cut the second rendering into the template's own
      text; the first rendering must be exactly that text with each message's text (as written or with
      its ends stripped) in between. Each assistant turn's span then follows from where its text lies.
      Rendering the whole conversation at once, not its prefixes, is what lets templates that render a
      turn differently once a later turn exists (Qwen3 drops earlier turns' reasoning) be masked.

    A conversation that neither method can mask is a :class:`LossMaskError` naming the template
    behaviour and the message, never a guessed mask. Char spans become tokens through the fast
    tokenizer's offset mapping: tokens overlapping a span are supervised.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import date, datetime, time
from typing import Any

from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template

#: Llama 3.1's own fallback date ("26 Jul 2024"): a fixed date, not today's.
DEFAULT_TEMPLATE_DATE = "2024-07-26"
#: Qwen3's own default (a template that never reads it is unaffected).
DEFAULT_ENABLE_THINKING = True
#: Names the renderer itself passes; a chat_template_kwargs entry cannot replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "strftime_now",
                                     "date_string", "enable_thinking"})
#: What Llama 3.x templates read as ``date_string`` ("%d %b %Y", their own format).
DATE_STRING_FORMAT = "%d %b %Y"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
THINK_TAGS = re.compile(r"(<think>|</think>)")


class ChatTemplateMissing(Exception):
    """The tokenizer has no chat template to render conversations with."""


class SlowTokenizer(Exception):
    """Loss masks need a fast tokenizer's offset mapping."""


class LossMaskError(Exception):
    """The loss mask of one conversation cannot be computed reliably with this template."""


# --------------------------------------------------------------------------- variables


@dataclass(frozen=True)
class TemplateVariables:
    """The template variables of a dataset version (see the module docstring)."""

    #: ISO date the template sees as today: ``date_string`` (Llama's "26 Jul 2024" form) and ``strftime_now``.
    date: str = DEFAULT_TEMPLATE_DATE
    enable_thinking: bool = DEFAULT_ENABLE_THINKING
    #: More variables for the template, JSON values (``chat_template_kwargs`` in vLLM/SGLang terms).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            date.fromisoformat(self.date)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"template date must be an ISO date like {DEFAULT_TEMPLATE_DATE}, not "
                             f"{self.date!r}") from exc
        clash = sorted(RESERVED_TEMPLATE_NAMES & set(self.chat_template_kwargs))
        if clash:
            raise ValueError(f"chat_template_kwargs cannot set {clash}: the renderer passes those (set the date "
                             f"and enable_thinking by their own parameters)")
        try:
            json.dumps(self.chat_template_kwargs, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"chat_template_kwargs must be JSON values: {exc}") from exc

    def record(self) -> dict[str, Any]:
        """The JSON form written to dataset.json and hashed into the version fingerprint."""
        return {"date": self.date, "enable_thinking": self.enable_thinking,
                "chat_template_kwargs": json.loads(json.dumps(self.chat_template_kwargs, sort_keys=True))}

    def template_kwargs(self) -> dict[str, Any]:
        """The variables as ``apply_chat_template`` keyword arguments (all but the clock)."""
        day = date.fromisoformat(self.date)
        return {"date_string": day.strftime(DATE_STRING_FORMAT), "enable_thinking": self.enable_thinking,
                **self.chat_template_kwargs}

    def strftime_now(self, fmt: str) -> str:
        """The template's clock, stopped at midnight of :attr:`date`."""
        return datetime.combine(date.fromisoformat(self.date), time()).strftime(fmt)


def template_hash(tokenizer) -> str:
    """sha256 (32 hex) of the chat template and the special tokens it can write; recorded per dataset."""
    template = tokenizer.chat_template
    if not template:
        raise ChatTemplateMissing(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    payload = json.dumps({"chat_template": template, "special_tokens": tokenizer.special_tokens_map},
                         sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Conversation:
    """Messages in the chat-template shape (role, content, and reasoning_content / tool_calls /
    tool_call_id / name where present) and the row's tool definitions, if any."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Masked:
    input_ids: list[int]
    loss_mask: list[int]
    #: "generation-tags" or "placeholders"
    method: str


@dataclass(frozen=True)
class _Field:
    message: int
    key: str      # "content" or "reasoning_content"
    text: str     # the piece (content is cut around <think> tags)
    probe: str


class ChatTemplate:
    """A tokenizer's chat template with fixed variables: renders conversations and masks them."""

    def __init__(self, tokenizer, variables: TemplateVariables = TemplateVariables()):
        if not tokenizer.chat_template:
            raise ChatTemplateMissing(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        if not tokenizer.is_fast:
            raise SlowTokenizer(f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer; loss masks need "
                                f"its offset mapping")
        self.tokenizer = tokenizer
        self.variables = variables
        self.source = tokenizer.get_chat_template()  # the default one of a tokenizer with named templates
        self.has_generation_tags = bool(GENERATION_TAG.search(self.source))
        added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self.special_ids = added | set(tokenizer.all_special_ids)
        self._template = _compile_jinja_template(self.source)
        self.generation_prompt, self.user_turn_end, self.end_of_turn = self._learn_turn_text()
        first = self.encode(self.generation_prompt)["input_ids"][:1]
        opener = self.tokenizer.convert_ids_to_tokens(first[0]) if first and first[0] in self.special_ids else None
        #: the special token that opens every turn (<|im_start|>, <|start|>...), if the prompt starts with one
        self.turn_opener = opener if opener and self.generation_prompt.startswith(opener) else None

    def render(self, conversation: Conversation, add_generation_prompt: bool = False) -> str:
        # What apply_chat_template does (special tokens as variables, reasoning under the names templates
        # read), with the clock stopped.
        return self._template.render(
            messages=_alias_reasoning_fields(conversation.messages), tools=conversation.tools, documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **self.variables.template_kwargs()},
            strftime_now=self.variables.strftime_now)

    def encode(self, text: str):
        return self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)

    def mask(self, conversation: Conversation) -> Masked:
        """Token ids of the rendered conversation and its loss mask; raises LossMaskError or a jinja2 error."""
        rendered = self.render(conversation)
        encoded = self.encode(rendered)
        input_ids = list(encoded["input_ids"])
        if self.has_generation_tags:
            loss_mask, method = self._mask_from_generation_tags(conversation, input_ids), "generation-tags"
        else:
            loss_mask = self._mask_from_placeholders(conversation, rendered, input_ids, encoded["offset_mapping"])
            method = "placeholders"
        supervised = sum(loss_mask)
        if supervised == 0:
            raise LossMaskError("loss mask is all zeros although the conversation has assistant turns")
        if supervised == len(loss_mask):
            raise LossMaskError("loss mask is all ones: the template wrote nothing but assistant content")
        return Masked(input_ids, loss_mask, method)

    # ----------------------------------------------------------------------- the template's own turn text

    def _learn_turn_text(self) -> tuple[str, str, str | None]:
        """(generation prompt, text closing a user turn, end-of-turn token closing an assistant turn)."""
        user = {"role": "user", "content": "Q7xUserProbe"}
        reply = {"role": "assistant", "content": "Q7xReplyProbe"}
        plain = self.render(Conversation([user]))
        prompted = self.render(Conversation([user]), add_generation_prompt=True)
        # The prompt is what follows the common part (Phi-3 ends a conversation without a prompt with eos).
        common = len(os.path.commonprefix([plain, prompted]))
        common = max((end for _, end in self.encode(plain)["offset_mapping"] if end <= common), default=0)
        # Templates that rewrite text (upper-case it...) hide the probes: no user-turn end, no end-of-turn.
        at = plain.find("Q7xUserProbe")
        user_turn_end = plain[at + len("Q7xUserProbe"):common] if at >= 0 else ""
        both = self.render(Conversation([user, reply]))
        at = both.rfind("Q7xReplyProbe")
        after_reply = both[at + len("Q7xReplyProbe"):] if at >= 0 else ""
        first = self.encode(after_reply)["input_ids"][:1]
        end_of_turn = self.tokenizer.convert_ids_to_tokens(first[0]) if first and first[0] in self.special_ids \
            else None
        if end_of_turn is not None and not after_reply.startswith(end_of_turn):
            end_of_turn = None  # a token whose text is not what the template wrote (byte-level names)
        return prompted[common:], user_turn_end, end_of_turn

    # ----------------------------------------------------------------------- {% generation %} tags

    def _mask_from_generation_tags(self, conversation: Conversation, input_ids: list[int]) -> list[int]:
        out = self.tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                                 return_dict=True, return_assistant_tokens_mask=True,
                                                 **self.variables.template_kwargs())
        if list(out["input_ids"]) != input_ids:
            raise LossMaskError("the template's {% generation %} mask comes from a rendering that differs from "
                                "the one with the fixed date (the template reads the clock through strftime_now)")
        return list(out["assistant_masks"])

    # ----------------------------------------------------------------------- placeholders

    def _mask_from_placeholders(self, conversation: Conversation, rendered: str, input_ids: list[int],
                                offsets: list[tuple[int, int]]) -> list[int]:
        messages = conversation.messages
        probed, fields = _with_placeholders(messages)
        skeleton = self.render(Conversation(probed, conversation.tools))
        found = []
        for f in fields:
            count = skeleton.count(f.probe)
            if count > 1:
                raise LossMaskError(f"the chat template writes the {f.key} of message {f.message} "
                                    f"({messages[f.message]['role']}) {count} times; its tokens cannot be told apart")
            if count == 1:
                found.append((skeleton.index(f.probe), f))
        found.sort(key=lambda pair: pair[0])
        spans = _align(rendered, skeleton, found, messages)  # field -> (start, end) in rendered

        by_message: dict[int, list[tuple[int, int]]] = {}
        for f, span in spans.items():
            by_message.setdefault(f.message, []).append(span)
        bounds = sorted(spans.values())
        loss_mask = [0] * len(input_ids)
        token_ends = [end for _, end in offsets]
        claimed: set[int] = set()
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            own = sorted(by_message.get(i, []))
            if own:
                text_start, text_end = own[0][0], own[-1][1]
                before = max((end for _, end in bounds if end <= text_start), default=0)
                header = self._header_end(rendered, before, text_start, last=True)
                start = header if header is not None else text_start
            elif message.get("tool_calls"):
                start = text_end = self._turn_without_text(i, rendered, by_message, claimed)
            else:
                raise LossMaskError(f"the chat template does not write the content of message {i} (assistant) "
                                    f"as given (it rewrites or drops it)")
            region_end = min((s for s, _ in bounds if s >= text_end), default=len(rendered))
            if message.get("tool_calls"):
                end = self._end_of_tool_call_turn(i, rendered, input_ids, offsets, text_end, region_end)
                _mark(loss_mask, offsets, token_ends, start, end)
            else:
                t = _mark(loss_mask, offsets, token_ends, start, text_end)
                if t < len(input_ids) and offsets[t][0] < region_end and input_ids[t] in self.special_ids:
                    loss_mask[t] = 1
        return loss_mask

    def _turn_without_text(self, i: int, rendered: str, spans_by_message: dict[int, list[tuple[int, int]]],
                           claimed: set[int]) -> int:
        """Start of the span of an assistant turn that is only tool calls: the end of the generation prompt
        between its neighbours' text (or, for templates without one, the end of the user turn before it)."""
        previous = max((j for j in spans_by_message if j < i), default=None)
        following = min((j for j in spans_by_message if j > i), default=None)
        region_start = max(end for _, end in spans_by_message[previous]) if previous is not None else 0
        region_end = min(s for s, _ in spans_by_message[following]) if following is not None else len(rendered)
        if region_start in claimed or region_start > region_end:
            raise LossMaskError(f"message {i} (assistant) is only tool calls and has no text of its own between "
                                f"other messages' text, so its turn cannot be told apart from its neighbours'")
        claimed.add(region_start)
        header = self._header_end(rendered, region_start, region_end, last=False)
        if header is not None:
            return header
        if not self.generation_prompt and self.user_turn_end and rendered.startswith(self.user_turn_end,
                                                                                      region_start):
            return region_start + len(self.user_turn_end)
        raise LossMaskError(f"message {i} (assistant) is only tool calls, and the chat template's generation prompt "
                            f"{self.generation_prompt!r} does not open its turn, so where it starts is unknown")

    def _header_end(self, rendered: str, start: int, end: int, last: bool) -> int | None:
        """End of the generation prompt in rendered[start:end] (its last occurrence if ``last``), or None.

        Also tried: the prompt's first line, for turns rendered without the prompt's tail (Qwen3 writes
        ``<think>\\n\\n</think>\\n\\n`` after the header only in the prompt when thinking is off)."""
        prompt = self.generation_prompt
        candidates = [prompt] + ([prompt[:prompt.index("\n") + 1]] if "\n" in prompt[:-1] else [])
        for header in candidates:
            if not header:
                continue
            at = rendered.rfind(header, start, end) if last else rendered.find(header, start, end)
            if at >= 0:
                return at + len(header)
        return None

    def _end_of_tool_call_turn(self, i: int, rendered: str, input_ids: list[int], offsets, after: int,
                               region_end: int) -> int:
        """End of the special token that closes an assistant turn of tool calls: the template's end-of-turn
        token, or (templates that close a call with another token, gpt-oss's ``<|call|>``) the special token
        right before the next turn opens."""
        if self.end_of_turn is not None:
            at = rendered.find(self.end_of_turn, after, region_end)
            if at >= 0:
                return at + len(self.end_of_turn)
        opens = rendered.find(self.turn_opener, after, region_end) if self.turn_opener else -1
        if opens > after:
            t = bisect.bisect_right([end for _, end in offsets], opens) - 1
            if t >= 0 and offsets[t][1] == opens and offsets[t][0] >= after and input_ids[t] in self.special_ids:
                return opens
        raise LossMaskError(f"message {i} (assistant) calls tools, and no special token closes its turn before "
                            f"the next message (the template's end-of-turn is {self.end_of_turn!r})")

def _mark(loss_mask: list[int], offsets, token_ends: list[int], start: int, end: int) -> int:
    """Set the mask on tokens overlapping [start, end); returns the index of the first token after them."""
    t = bisect.bisect_right(token_ends, start)
    while t < len(loss_mask) and offsets[t][0] < end:
        loss_mask[t] = 1
        t += 1
    return t


def _with_placeholders(messages: list[dict]) -> tuple[list[dict], list[_Field]]:
    """The messages with each text piece replaced by a unique placeholder, and the pieces.

    Content is cut around ``<think>``/``</think>`` so a template that parses an inline think block sees
    one in the placeholder version too; whitespace-only pieces stay as they are.
    """
    probed, fields = [], []
    for i, message in enumerate(messages):
        copy = dict(message)
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if not isinstance(value, str) or not value:
                continue
            pieces = THINK_TAGS.split(value) if key == "content" else [value]
            out = []
            for piece in pieces:
                if piece in ("<think>", "</think>") or not piece.strip():
                    out.append(piece)
                    continue
                probe = f"Q7xP{len(fields):04d}x"
                fields.append(_Field(i, key, piece, probe))
                out.append(probe)
            copy[key] = "".join(out)
        probed.append(copy)
    return probed, fields


def _variants(text: str) -> list[str]:
    """How templates write a text: as is, with its ends stripped (``trim``, ``strip('\\n')``, ...), or
    escaped as the inside of a JSON string (Llama 3 writes a tool result with ``tojson``)."""
    seen: list[str] = []
    for variant in (text, text.strip(), text.strip("\n"), text.lstrip("\n"), text.rstrip("\n"), text.lstrip(),
                    text.rstrip(), json.dumps(text, ensure_ascii=False)[1:-1]):
        if variant not in seen:
            seen.append(variant)
    return seen


def _align(rendered: str, skeleton: str, found: list[tuple[int, _Field]],
           messages: list[dict]) -> dict[_Field, tuple[int, int]]:
    """Char span in ``rendered`` of each placed field: the skeleton's text between placeholders must
    appear verbatim, each field's text (a variant of it) in between."""
    pieces = []  # template text before each field, then the tail
    previous = 0
    for at, f in found:
        pieces.append(skeleton[previous:at])
        previous = at + len(f.probe)
    tail = skeleton[previous:]
    spans: dict[_Field, tuple[int, int]] = {}
    pos = 0
    for k, (_, f) in enumerate(found):
        before = pieces[k]
        if not rendered.startswith(before, pos):
            raise LossMaskError(f"the chat template writes different text around the {f.key} of message "
                                f"{f.message} ({messages[f.message]['role']}) depending on the messages' text (it "
                                f"inspects or rewrites it), so that text cannot be located")
        pos += len(before)
        following = pieces[k + 1] if k + 1 < len(found) else tail
        for variant in _variants(f.text):
            after = pos + len(variant)
            if rendered.startswith(variant, pos) and (rendered.startswith(following, after) if k + 1 < len(found)
                                                      else rendered[after:] == following):
                spans[f] = (pos, after)
                pos = after
                break
        else:
            raise LossMaskError(f"the {f.key} of message {f.message} ({messages[f.message]['role']}) does not "
                                f"appear in the rendered conversation as written or with its ends stripped; the "
                                f"template rewrites it")
    if rendered[pos:] != tail:
        raise LossMaskError("the chat template writes this conversation differently when its messages' text is "
                            "replaced by placeholders (it inspects or rewrites the text), so the text cannot be "
                            "located")
    return spans

