"""Prompt preparation: conversation files in, token ids and loss masks out.

Input files
    ``.jsonl`` (one row per line; blank lines are not rows), ``.json`` (a list of rows) or
    ``.parquet``. A row is either OpenAI-shaped, ``{"id": ..., "messages": [{"role", "content"}]}``,
    or ShareGPT-shaped, ``{"id": ..., "conversations": [{"from", "value"}]}``. ``id`` is optional;
    without it the row is named ``line-{n}``. ``n`` is the line number in a JSONL file and the
    1-based row number in a JSON list or a Parquet table. Only role and content are rendered.

Token ids
    ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)``,
    tokenized without adding special tokens (the template writes them), i.e. exactly the ids
    ``apply_chat_template(messages, tokenize=True)`` gives.

Loss mask (SpecForge's convention)
    1 on the tokens of every assistant message's content and on the end-of-turn token that
    closes it, 0 elsewhere. The method needs no ``{% generation %}`` tags: for each assistant
    message ``i`` it renders ``messages[:i+1]`` (a prefix of the whole rendering) and the same
    with a probe string in place of message ``i``'s content; the text around the probe is the
    template's, and the rendering must be exactly that text with the content (as written, or
    stripped for templates that ``trim``) in between. Char spans become tokens through the fast
    tokenizer's offset mapping; tokens overlapping the content are supervised. The end-of-turn token is the first token after the content when
    it is a special token (``<|eot_id|>``, ``<|im_end|>``, ``</s>``); templates that close a turn
    with plain text supervise the content only.

Sample key
    ``sample_key(input_ids, loss_mask)``: sha256 over the int64 ids AND the mask bytes, so two
    rows are duplicates only when they would train identically. The first row with a key is
    kept; later ones are recorded as :class:`Duplicate`.

Accounting
    Every row read is a sample, a duplicate or a reject: ``rows_in == len(samples) +
    len(duplicates) + len(rejected)`` (checked when the result is built).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import jinja2
import polars as pl

from tasks.samples import PreparedSample

ON_OVERLONG = ("truncate", "skip")

#: roles a row may use, per shape, and the chat-template role each one means.
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user",
                  "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


# --------------------------------------------------------------------------- errors


class PromptFileError(Exception):
    """The prompt file as a whole cannot be read (missing, unknown format, not a list of rows)."""

    def __init__(self, path: Path | str, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"prompt file {path}: {reason}")


class MalformedRow(Exception):
    """One row cannot be parsed (bad JSON, not an object); it becomes a reject, the file goes on."""

    def __init__(self, path: Path | str, line: int, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path} line {line}: {reason}")


class ChatTemplateMissing(Exception):
    """The tokenizer has no chat template to render conversations with."""


class SlowTokenizer(Exception):
    """Loss masks need a fast tokenizer's offset mapping."""


class LossMaskError(Exception):
    """The loss mask of one conversation cannot be computed correctly with this template."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Rejected:
    line: int
    #: None only when the row could not be parsed at all.
    source_id: str | None
    reason: str


@dataclass(frozen=True)
class Duplicate:
    line: int
    source_id: str
    sample_key: str
    #: the id of the row that was kept with this key.
    first_source_id: str


@dataclass
class PreparedPrompts:
    samples: list[PreparedSample]
    rejected: list[Rejected]
    duplicates: list[Duplicate]
    rows_in: int

    def __post_init__(self) -> None:
        accounted = len(self.samples) + len(self.duplicates) + len(self.rejected)
        if accounted != self.rows_in:
            raise RuntimeError(f"prompt accounting is off: {self.rows_in} rows in, {len(self.samples)} samples + "
                               f"{len(self.duplicates)} duplicates + {len(self.rejected)} rejected = {accounted}")


class _RowRejected(Exception):
    """Internal: why one row is rejected (becomes a :class:`Rejected`)."""


# --------------------------------------------------------------------------- reading


def read_conversations(path: Path | str) -> Iterator[tuple[int, dict | Exception]]:
    """Yield ``(line number, row)`` for each row, or ``(line number, MalformedRow)`` for one that does not parse."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif suffix == ".json":
        yield from _read_json_list(path)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise PromptFileError(path, f"unknown format {suffix!r}; expected .jsonl, .json or .parquet")


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict | Exception]]:
    with path.open("r", encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield number, MalformedRow(path, number, f"bad JSON: {exc}")
                continue
            yield number, _object_or_error(path, number, row)


def _read_json_list(path: Path) -> Iterator[tuple[int, dict | Exception]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromptFileError(path, f"bad JSON: {exc}") from exc
    if not isinstance(rows, list):
        raise PromptFileError(path, f"a .json prompt file holds a list of rows, not a {type(rows).__name__}")
    for number, row in enumerate(rows, start=1):
        yield number, _object_or_error(path, number, row)


def _read_parquet(path: Path) -> Iterator[tuple[int, dict | Exception]]:
    for number, row in enumerate(pl.read_parquet(path).iter_rows(named=True), start=1):
        yield number, row


def _object_or_error(path: Path, number: int, row: object) -> dict | Exception:
    if isinstance(row, dict):
        return row
    return MalformedRow(path, number, f"a row is a JSON object, not a {type(row).__name__}")


def source_id_of(row: dict, line: int) -> str:
    """The row's own id, or ``line-{n}`` when it has none."""
    value = row.get("id")
    return f"line-{line}" if value is None or value == "" else str(value)


def normalize_messages(row: dict) -> list[dict[str, str]]:
    """The row's messages as ``[{"role", "content"}]`` with template roles; raises ``_RowRejected``."""
    # A null field counts as absent: a Parquet table holding both shapes has both columns.
    has_messages, has_conversations = row.get("messages") is not None, row.get("conversations") is not None
    if has_messages and has_conversations:
        raise _RowRejected("malformed row: has both 'messages' and 'conversations'")
    if has_messages:
        field, role_key, content_key, roles = "messages", "role", "content", OPENAI_ROLES
    elif has_conversations:
        field, role_key, content_key, roles = "conversations", "from", "value", SHAREGPT_ROLES
    else:
        raise _RowRejected("malformed row: no 'messages' or 'conversations' field")
    raw = row[field]
    if not isinstance(raw, list) or not raw:
        raise _RowRejected(f"malformed row: {field!r} is not a non-empty list")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _RowRejected(f"malformed row: message {i} is a {type(message).__name__}, not an object")
        role, content = message.get(role_key), message.get(content_key)
        if role not in roles:
            raise _RowRejected(f"unknown role {role!r} in message {i}; known: {', '.join(sorted(roles))}")
        if not isinstance(content, str):
            raise _RowRejected(f"malformed row: content of message {i} is a {type(content).__name__}, not a string")
        if not content.strip():
            raise _RowRejected(f"empty content in message {i} ({role})")
        messages.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise _RowRejected("no assistant turn")
    return messages


# --------------------------------------------------------------------------- rendering and masks


def template_hash(tokenizer) -> str:
    """sha256 (32 hex) of the chat template and the special tokens it can write; recorded per dataset."""
    template = tokenizer.chat_template
    if not template:
        raise ChatTemplateMissing(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    payload = json.dumps({"chat_template": template, "special_tokens": tokenizer.special_tokens_map},
                         sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def sample_key(input_ids: Sequence[int], loss_mask: Sequence[int]) -> str:
    """Content key of a training sample: sha256 over int64 ids then one byte per mask entry (32 hex)."""
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"{len(input_ids)} ids but {len(loss_mask)} mask entries")
    ids = array.array("q", input_ids)
    if ids.itemsize != 8:
        raise RuntimeError("array('q') is not 64-bit on this platform")
    digest = hashlib.sha256(ids.tobytes())
    digest.update(bytes(loss_mask))
    return digest.hexdigest()[:32]


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


#: stands in for an assistant message's content to learn where the template puts it; no whitespace at
#: its ends (templates that ``trim`` keep it) and nothing a real conversation would contain.
CONTENT_PROBE = "Q7xContentProbe3f9b"


def assistant_spans(tokenizer, messages: list[dict], rendered: str) -> list[tuple[int, int, int]]:
    """``(content start, content end, turn end)`` char offsets in ``rendered`` of each assistant message."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = _render(tokenizer, messages[: i + 1])
        if not rendered.startswith(through):
            raise LossMaskError(f"the chat template renders messages[:{i + 1}] differently inside the whole "
                                f"conversation, so message {i}'s text cannot be located")
        # The same prefix with a probe for message i's content: the text before the probe is what the
        # template writes before the content (earlier turns, the assistant header), the text after it
        # closes the turn. The real rendering must be exactly that with the content in between.
        probe = _render(tokenizer, messages[:i] + [{"role": "assistant", "content": CONTENT_PROBE}])
        at = probe.find(CONTENT_PROBE)
        if at < 0:
            raise LossMaskError(f"the chat template does not write assistant content verbatim (a probe for "
                                f"message {i} disappeared)")
        head, tail = probe[:at], probe[at + len(CONTENT_PROBE):]
        for text in (message["content"], message["content"].strip()):
            if through == head + text + tail:
                spans.append((len(head), len(head) + len(text), len(through)))
                break
        else:
            raise LossMaskError(f"the content of message {i} (assistant) does not appear in the rendered "
                                f"conversation, as written or stripped; the template rewrites it")
    return spans


def compute_loss_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its loss mask (see the module docstring)."""
    if not tokenizer.chat_template:
        raise ChatTemplateMissing(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
    if not tokenizer.is_fast:
        raise SlowTokenizer(f"tokenizer {tokenizer.name_or_path!r} is not a fast tokenizer; loss masks need "
                            f"its offset mapping")
    rendered = _render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, rendered)
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    token_ends = [end for _, end in offsets]
    special_ids = _special_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    for start, end, turn_end in spans:
        # First token that ends after the content starts: tokens overlapping the content are supervised.
        t = bisect.bisect_right(token_ends, start)
        while t < len(input_ids) and offsets[t][0] < end:
            loss_mask[t] = 1
            t += 1
        if t < len(input_ids) and offsets[t][0] < turn_end and input_ids[t] in special_ids:
            loss_mask[t] = 1
    supervised = sum(loss_mask)
    if supervised == 0:
        raise LossMaskError("loss mask is all zeros although the conversation has assistant turns")
    if supervised == len(loss_mask):
        raise LossMaskError("loss mask is all ones: the template wrote nothing but assistant content")
    return input_ids, loss_mask


def _special_ids(tokenizer) -> set[int]:
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


# --------------------------------------------------------------------------- the whole file


def prepare_prompts(path: Path | str, tokenizer, max_length: int = 2048,
                    on_overlong: str = "truncate") -> PreparedPrompts:
    """Read, render, mask, cut to ``max_length`` and de-duplicate every conversation of ``path``."""
    if on_overlong not in ON_OVERLONG:
        raise ValueError(f"on_overlong must be one of {ON_OVERLONG}, not {on_overlong!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, not {max_length}")
    template_hash(tokenizer)  # fails fast, naming the tokenizer, when there is no template
    samples: list[PreparedSample] = []
    rejected: list[Rejected] = []
    duplicates: list[Duplicate] = []
    first_by_key: dict[str, str] = {}
    line_by_id: dict[str, int] = {}
    rows_in = 0
    for line, row in read_conversations(path):
        rows_in += 1
        if isinstance(row, Exception):
            rejected.append(Rejected(line, None, f"malformed row: {row.reason}"))
            continue
        source_id = source_id_of(row, line)
        try:
            sample = _prepare_row(tokenizer, row, source_id, line, max_length, on_overlong)
        except _RowRejected as exc:
            rejected.append(Rejected(line, source_id, str(exc)))
            continue
        if sample.sample_key in first_by_key:
            duplicates.append(Duplicate(line, source_id, sample.sample_key, first_by_key[sample.sample_key]))
            continue
        if source_id in line_by_id:
            rejected.append(Rejected(line, source_id, f"duplicate id: {source_id!r} already names the different "
                                                      f"conversation on line {line_by_id[source_id]}"))
            continue
        first_by_key[sample.sample_key] = source_id
        line_by_id[source_id] = line
        samples.append(sample)
    return PreparedPrompts(samples, rejected, duplicates, rows_in)


def _prepare_row(tokenizer, row: dict, source_id: str, line: int, max_length: int,
                 on_overlong: str) -> PreparedSample:
    messages = normalize_messages(row)
    try:
        input_ids, loss_mask = compute_loss_mask(tokenizer, messages)
    except jinja2.TemplateError as exc:
        raise _RowRejected(f"chat template refused the conversation: {exc}") from exc
    except LossMaskError as exc:
        raise _RowRejected(f"loss mask: {exc}") from exc
    truncated = len(input_ids) > max_length
    if truncated:
        if on_overlong == "skip":
            raise _RowRejected(f"too long: {len(input_ids)} tokens > max_length {max_length} (on_overlong=skip)")
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if not any(loss_mask):
            raise _RowRejected(f"nothing supervised after truncation to max_length {max_length}: the first "
                               f"assistant token is beyond it")
    return PreparedSample(sample_key(input_ids, loss_mask), source_id, line, input_ids, loss_mask, truncated)


def write_rejects(path: Path | str, rejected: Sequence[Rejected]) -> Path:
    """Write the rejects as JSONL (``line``, ``source_id``, ``reason``), atomically; an empty list gives an empty file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rejected:
            f.write(json.dumps({"line": r.line, "source_id": r.source_id, "reason": r.reason},
                               ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
