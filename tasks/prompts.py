"""Prompt preparation: conversation files in, token ids and loss masks out.

Input files
    ``.jsonl`` (one row per line; blank lines are not rows), ``.json`` (a list of rows) or
    ``.parquet``. A row is either OpenAI-shaped, ``{"id": ..., "messages": [...], "tools": [...]}``,
    or ShareGPT-shaped, ``{"id": ..., "conversations": [{"from", "value"}], "tools": [...]}``. ``id`` is
    optional; without it the row is named ``line-{n}``. ``n`` is the line number in a JSONL file and the
    1-based row number in a JSON list or a Parquet table. ``tools`` (optional) is the list of tool
    definitions the template writes into its system prompt.

    The source is one such file, or a folder or glob of them (:func:`prompt_files`), read in name
    order: a folder that grows is the nightly run's source. With several files a row without an id
    is named ``{file name}:line-{n}`` (its file path relative to the folder, or the file name for a
    glob), so that ids do not collide across files and stay the same as files are added.

Messages
    OpenAI: ``role`` system, user, assistant or tool; ``content`` a string. An assistant message may
    carry ``reasoning_content`` (a string) and ``tool_calls`` (``[{"type": "function", "function":
    {"name", "arguments"}, "id"?}]``, arguments a JSON object or its JSON text; its content may then be
    empty); a tool message may carry ``tool_call_id`` and ``name``. ShareGPT: ``from`` system, human/user,
    gpt/chatgpt/assistant, ``function_call`` (``value`` is the call's JSON, ``{"name", "arguments"}``: an
    assistant message calling that tool) or ``observation`` (a tool result). Tool calls are assistant
    output and supervised; tool results are not. Both are counted (:class:`PreparedPrompts`).

Token ids and loss mask
    :mod:`tasks.chat_template`: the model's template rendered with fixed variables
    (:class:`~tasks.chat_template.TemplateVariables`), the mask on what the model writes in each
    assistant turn plus the end-of-turn token. A conversation the template refuses (``raise_exception``)
    is rejected with the template's message; one whose mask cannot be computed reliably is rejected with
    the template behaviour that prevents it.

Sample key
    ``sample_key(input_ids, loss_mask)``: sha256 over the int64 ids AND the mask bytes, so two
    rows are duplicates only when they would train identically. The first row with a key is
    kept; later ones are recorded as :class:`Duplicate`.

Accounting
    Every row read is a sample, a duplicate or a reject: ``rows_in == len(samples) +
    len(duplicates) + len(rejected)`` (checked when the result is built).

Checking a template by eye
    ``python -m tasks.prompts show --model-path DIR --prompts FILE --row N`` prints row N as the model
    sees it with the supervised tokens in colour (see :func:`main`).
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import jinja2
import polars as pl

from tasks.chat_template import ChatTemplate, Conversation, LossMaskError, TemplateVariables
from tasks.samples import PreparedSample

ON_OVERLONG = ("truncate", "skip")

#: roles a row may use, per shape, and the chat-template role each one means.
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "chatgpt": "assistant", "assistant": "assistant", "function_call": "assistant",
                  "observation": "tool"}


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
    #: in the samples written (not in duplicates or rejects): assistant tool calls (supervised) and tool
    #: results (not supervised).
    tool_calls: int = 0
    tool_results: int = 0

    def __post_init__(self) -> None:
        accounted = len(self.samples) + len(self.duplicates) + len(self.rejected)
        if accounted != self.rows_in:
            raise RuntimeError(f"prompt accounting is off: {self.rows_in} rows in, {len(self.samples)} samples + "
                               f"{len(self.duplicates)} duplicates + {len(self.rejected)} rejected = {accounted}")


class _RowRejected(Exception):
    """Internal: why one row is rejected (becomes a :class:`Rejected`)."""


# --------------------------------------------------------------------------- reading


PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet")


def prompt_files(source: Path | str) -> list[tuple[Path, str | None]]:
    """``(file, label)`` for each prompt file of ``source`` in name order: a file (label None), a folder
    (its .jsonl/.json/.parquet files, recursively; label: the path under it) or a glob (label: file name)."""
    source = Path(source).expanduser()
    if source.is_file():
        return [(source, None)]
    if source.is_dir():
        found = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in PROMPT_SUFFIXES)
        if not found:
            raise PromptFileError(source, f"folder holds no {', '.join(PROMPT_SUFFIXES)} files")
        return [(p, p.relative_to(source).as_posix()) for p in found]
    if any(c in str(source) for c in "*?["):
        root = Path(source.anchor) if source.is_absolute() else Path(".")
        pattern = str(source.relative_to(root)) if source.is_absolute() else str(source)
        found = sorted(p for p in root.glob(pattern) if p.is_file())
        if not found:
            raise PromptFileError(source, "the glob matches no file")
        labels = [p.name for p in found]
        if len(set(labels)) < len(labels):
            labels = [str(p) for p in found]  # same name in two folders: the whole path keeps ids apart
        return list(zip(found, labels))
    raise PromptFileError(source, "no such file, folder or glob")


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


def source_id_of(row: dict, line: int, label: str | None = None) -> str:
    """The row's own id, or ``line-{n}`` (``{label}:line-{n}`` for a file of several) when it has none."""
    value = row.get("id")
    if value is None or value == "":
        return f"line-{line}" if label is None else f"{label}:line-{line}"
    return str(value)


def normalize_conversation(row: dict) -> Conversation:
    """The row as a :class:`Conversation` with template roles; raises ``_RowRejected``."""
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
        role = message.get(role_key)
        if role not in roles:
            raise _RowRejected(f"unknown role {role!r} in message {i}; known: {', '.join(sorted(roles))}")
        if role == "function_call":
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [_tool_call(_json_object(message.get(content_key), i), i)]})
            continue
        normalized = {"role": roles[role], "content": message.get(content_key)}
        tool_calls = message.get("tool_calls") if field == "messages" else None
        if tool_calls is not None and roles[role] == "assistant":
            if not isinstance(tool_calls, list) or not tool_calls:
                raise _RowRejected(f"malformed row: tool_calls of message {i} is not a non-empty list")
            normalized["tool_calls"] = [_tool_call(call, i) for call in tool_calls]
            if normalized["content"] is None:
                normalized["content"] = ""
        content = normalized["content"]
        if not isinstance(content, str):
            raise _RowRejected(f"malformed row: content of message {i} is a {type(content).__name__}, not a string")
        if not content.strip() and "tool_calls" not in normalized:
            raise _RowRejected(f"empty content in message {i} ({roles[role]})")
        if field == "messages":
            reasoning = message.get("reasoning_content")
            if reasoning is not None and roles[role] == "assistant":
                if not isinstance(reasoning, str):
                    raise _RowRejected(f"malformed row: reasoning_content of message {i} is a "
                                       f"{type(reasoning).__name__}, not a string")
                normalized["reasoning_content"] = reasoning
            for key in ("tool_call_id", "name"):
                if roles[role] == "tool" and message.get(key) is not None:
                    normalized[key] = str(message[key])
        messages.append(normalized)
    if not any(m["role"] == "assistant" for m in messages):
        raise _RowRejected("no assistant turn")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _RowRejected("malformed row: 'tools' is not a list of objects")
    return Conversation(messages, tools or None)


def _json_object(value: Any, i: int) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _RowRejected(f"malformed row: function_call of message {i} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _RowRejected(f"malformed row: function_call of message {i} is not a JSON object")
    return value


def _tool_call(call: Any, i: int) -> dict:
    """A tool call in the shape templates read: ``{"type": "function", "function": {"name", "arguments"}}``
    with arguments an object (templates write them with ``tojson``; JSON text would be quoted twice)."""
    if not isinstance(call, dict):
        raise _RowRejected(f"malformed row: a tool call of message {i} is a {type(call).__name__}, not an object")
    function = call.get("function", call)  # ShareGPT's function_call is the function itself
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise _RowRejected(f"malformed row: a tool call of message {i} has no function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise _RowRejected(f"malformed row: the arguments of tool call {name!r} in message {i} are not JSON: "
                               f"{exc}") from exc
    if not isinstance(arguments, dict):
        raise _RowRejected(f"malformed row: the arguments of tool call {name!r} in message {i} are not an object")
    normalized = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        normalized["id"] = str(call["id"])
    return normalized


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


# --------------------------------------------------------------------------- the whole file


def prepare_prompts(path: Path | str, tokenizer, max_length: int = 2048, on_overlong: str = "truncate",
                    variables: TemplateVariables = TemplateVariables()) -> PreparedPrompts:
    """Read, render, mask, cut to ``max_length`` and de-duplicate every conversation of ``path``
    (a file, folder or glob: :func:`prompt_files`)."""
    if on_overlong not in ON_OVERLONG:
        raise ValueError(f"on_overlong must be one of {ON_OVERLONG}, not {on_overlong!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, not {max_length}")
    template = ChatTemplate(tokenizer, variables)  # fails fast, naming the tokenizer, when there is no template
    samples: list[PreparedSample] = []
    rejected: list[Rejected] = []
    duplicates: list[Duplicate] = []
    first_by_key: dict[str, str] = {}
    line_by_id: dict[str, int] = {}
    rows_in = tool_calls = tool_results = 0
    rows = ((label, line, row) for file, label in prompt_files(path) for line, row in read_conversations(file))
    for label, line, row in rows:
        rows_in += 1
        if isinstance(row, Exception):
            where = "" if label is None else f" (in {label})"
            rejected.append(Rejected(line, None, f"malformed row{where}: {row.reason}"))
            continue
        source_id = source_id_of(row, line, label)
        try:
            conversation = normalize_conversation(row)
            sample = _prepare_row(template, conversation, source_id, line, max_length, on_overlong)
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
        tool_calls += sum(len(m.get("tool_calls", ())) for m in conversation.messages)
        tool_results += sum(m["role"] == "tool" for m in conversation.messages)
    if rows_in == 0:
        raise PromptFileError(path, "no rows: nothing to extract (an empty input is an error, not a success)")
    return PreparedPrompts(samples, rejected, duplicates, rows_in, tool_calls, tool_results)


def _masked(template: ChatTemplate, conversation: Conversation) -> tuple[list[int], list[int]]:
    try:
        masked = template.mask(conversation)
    except jinja2.TemplateError as exc:
        raise _RowRejected(f"chat template refused the conversation: {exc}") from exc
    except LossMaskError as exc:
        raise _RowRejected(f"loss mask: {exc}") from exc
    return masked.input_ids, masked.loss_mask


def _prepare_row(template: ChatTemplate, conversation: Conversation, source_id: str, line: int, max_length: int,
                 on_overlong: str) -> PreparedSample:
    input_ids, loss_mask = _masked(template, conversation)
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


# --------------------------------------------------------------------------- checking a template by eye

SUPERVISED_ON, SUPERVISED_OFF = "\x1b[1;30;42m", "\x1b[0m"  # black on green
PLAIN_OPEN, PLAIN_CLOSE = "[[", "]]"


def highlight(rendered: str, offsets: Sequence[tuple[int, int]], loss_mask: Sequence[int], colour: bool) -> str:
    """The rendered text with every character of a supervised token marked (colour, or [[...]] without)."""
    supervised = [False] * len(rendered)
    for (start, end), bit in zip(offsets, loss_mask):
        if bit:
            supervised[start:end] = [True] * (end - start)
    on, off = (SUPERVISED_ON, SUPERVISED_OFF) if colour else (PLAIN_OPEN, PLAIN_CLOSE)
    out, inside = [], False
    for char, flag in zip(rendered, supervised):
        if flag != inside:
            out.append(on if flag else off)
            inside = flag
        out.append(char)
    if inside:
        out.append(off)
    return "".join(out)


def show_row(path: Path | str, tokenizer, line: int, variables: TemplateVariables, colour: bool) -> tuple[str, bool]:
    """Row ``line`` (its line number, as in rejects.jsonl) rendered with its mask marked; (text, accepted)."""
    for number, row in read_conversations(path):
        if number != line:
            continue
        if isinstance(row, Exception):
            return f"line {line}: rejected: malformed row: {row.reason}", False
        source_id = source_id_of(row, line)
        template = ChatTemplate(tokenizer, variables)
        try:
            conversation = normalize_conversation(row)
            input_ids, loss_mask = _masked(template, conversation)
        except _RowRejected as exc:
            return f"line {line} ({source_id}): rejected: {exc}", False
        rendered = template.render(conversation)
        offsets = template.encode(rendered)["offset_mapping"]
        method = "generation tags" if template.has_generation_tags else "placeholders"
        head = (f"line {line} ({source_id}): {len(input_ids)} tokens, {sum(loss_mask)} supervised "
                f"(mask by {method}; template variables {json.dumps(variables.record(), sort_keys=True)})")
        return head + "\n" + highlight(rendered, offsets, loss_mask, colour), True
    raise PromptFileError(path, f"no row on line {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.prompts", description="Prompt preparation tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print one conversation as the model sees it, supervised tokens marked")
    show.add_argument("--model-path", required=True, type=Path, help="model (or tokenizer) folder")
    show.add_argument("--prompts", required=True, type=Path, help="prompt file (JSONL, JSON or Parquet)")
    show.add_argument("--row", required=True, type=int, metavar="N",
                      help="the row's line number (JSONL) or 1-based row number (JSON, Parquet), as in rejects.jsonl")
    show.add_argument("--template-date", default=TemplateVariables.date, metavar="YYYY-MM-DD")
    show.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction,
                      default=TemplateVariables.enable_thinking)
    show.add_argument("--chat-template-kwargs", type=json.loads, default={}, metavar="JSON")
    show.add_argument("--colour", "--color", choices=["auto", "always", "never"], default="auto",
                      help="auto: colour on a terminal, [[...]] around supervised text otherwise")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    variables = TemplateVariables(args.template_date, args.enable_thinking, args.chat_template_kwargs)
    colour = args.colour == "always" or (args.colour == "auto" and sys.stdout.isatty())
    text, accepted = show_row(args.prompts, tokenizer, args.row, variables, colour)
    print(text)
    return 0 if accepted else 1


if __name__ == "__main__":
    sys.exit(main())
