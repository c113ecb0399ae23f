"""The untagged JSON formats, where the whole reply is the call:

- Llama 3.x: one JSON object `{"name": "f", "parameters": {...}}` (optionally after `<|python_tag|>`), or several
  separated by `;`;
- Mistral (v3 tokenizers and later): `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`, one JSON list.
  `[TOOL_CALLS]` is a special token that decoding drops, so a bare list counts too; where the token is kept,
  text before it is content. The newer tokenizers (v11 on: Mistral Small 3.2, Magistral, Devstral) write one
  call per tag, `[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}` (v13 adds `[CALL_ID]id` before `[ARGS]`);
  that form is read only where decoding keeps the tags.

Both also read Hermes `<tool_call>` tags (some fine-tunes of these families write them). While streaming, a call
is whole once its JSON object closes (`llama3_closed`, `mistral_closed`): a JSON value ends itself."""

from __future__ import annotations

import json
import re

from skulk.formats.tool_parsers.base import RawCall, all_or_none, closed_by, json_call, loads
from skulk.formats.tool_parsers.tagged import CLOSE, OPEN, hermes_split

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()
_NAMED = re.compile(r"\s*" + re.escape(MISTRAL_TAG) + r"\s*([^\s\[\]{]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]")
_hermes_closed = closed_by(hermes_split, (CLOSE,))


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _value_at(text: str, at: int) -> tuple[object, int] | None:
    """The JSON value that starts at `at` (after blanks) and where it ends; None while it is not whole."""
    try:
        return _DECODER.raw_decode(text, _skip(text, at))
    except ValueError:
        return None


def _objects(body: str) -> list[object] | None:
    """JSON values back to back, separated by `;` (Llama 3's parallel calls); None if anything else is there."""
    out: list[object] = []
    at = 0
    while True:
        while at < len(body) and body[at].isspace():
            at += 1
        try:
            value, at = _DECODER.raw_decode(body, at)
        except ValueError:
            return None
        out.append(value)
        rest = body[at:].lstrip()
        if not rest:
            return out
        if not rest.startswith(";"):
            return None
        at = len(body) - len(rest) + 1


def llama3_split(text: str) -> tuple[str, list[RawCall]] | None:
    if OPEN in text:
        return hermes_split(text)
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    values = _objects(body) if body.startswith("{") else None
    calls = all_or_none([json_call(v) for v in values]) if values is not None else None
    return ("", calls) if calls is not None else None


def llama3_closed(text: str) -> tuple[int, list[RawCall]]:
    """The objects written so far, each whole (`;` between them), while every one is a call."""
    if OPEN in text:
        return _hermes_closed(text)
    at = _skip(text, 0)
    at = _skip(text, at + len(PYTHON_TAG)) if text.startswith(PYTHON_TAG, at) else at
    values, end = [], 0
    while at < len(text) and text[at] == "{" and (read := _value_at(text, at)) is not None:
        values.append(read[0])
        end = read[1]
        at = _skip(text, end)
        if not text.startswith(";", at):
            break
        at = _skip(text, at + 1)
    calls = all_or_none([json_call(v) for v in values])
    return (end, calls) if calls is not None else (0, [])


def llama3_bare(text: str) -> bool:
    head = text.lstrip()
    return head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)


def _named_calls(text: str, at: int) -> tuple[int, list[RawCall | None], bool]:
    """The `[TOOL_CALLS]f[ARGS]{...}` calls from `at`: (where the last whole one ends, the calls, whether nothing
    else follows them)."""
    out: list[RawCall | None] = []
    end = at
    while (m := _NAMED.match(text, end)) is not None and (read := _value_at(text, m.end())) is not None:
        out.append((m.group(1), read[0]) if isinstance(read[0], dict) else None)
        end = read[1]
    return end, out, not text[end:].strip()


def _is_named(tag: str, body: str) -> bool:
    return bool(tag) and not body.lstrip().startswith("[")


def _list_items(text: str, at: int) -> tuple[int, list[object]]:
    """The whole items of the JSON list that starts at `at`, and where the last ends (after `]` once it closed)."""
    at = _skip(text, at)
    if not text.startswith("[", at):
        return 0, []
    items: list[object] = []
    end, at = 0, at + 1
    while (read := _value_at(text, at)) is not None:
        items.append(read[0])
        end = at = _skip(text, read[1])
        if text.startswith("]", at):
            return at + 1, items
        if not text.startswith(",", at):
            break
        at += 1
    return end, items


def _mistral_parts(text: str) -> tuple[str, str, str]:
    """(text before [TOOL_CALLS], the tag, what follows it); without the tag (a tokenizer that drops it), all of
    the text is what follows."""
    head, tag, body = text.partition(MISTRAL_TAG)
    return (head, tag, body) if tag else ("", tag, text)


def mistral_closed(text: str) -> tuple[int, list[RawCall]]:
    """The calls whose JSON has closed: list items one by one, or each `[TOOL_CALLS]f[ARGS]{...}`."""
    if OPEN in text:
        return _hermes_closed(text)
    head, tag, body = _mistral_parts(text)
    if _is_named(tag, body):
        end, named, _ = _named_calls(text, len(head))
        calls = all_or_none(named)
    else:
        end, items = _list_items(text, len(text) - len(body))
        calls = all_or_none([json_call(v) for v in items])
    return (end, calls) if calls is not None else (0, [])


def mistral_split(text: str) -> tuple[str, list[RawCall]] | None:
    if OPEN in text:
        return hermes_split(text)
    head, tag, body = _mistral_parts(text)
    if _is_named(tag, body):
        _, named, whole = _named_calls(text, len(head))
        calls = all_or_none(named) if whole else None
        return (head.strip(), calls) if calls is not None else None
    value = loads(body.strip())
    calls = all_or_none([json_call(v) for v in value]) if isinstance(value, list) else None
    return (head.strip(), calls) if calls is not None else None


def mistral_bare(text: str) -> bool:
    return text.lstrip().startswith("[")  # the list itself, or [TOOL_CALLS] kept by a tokenizer that shows it
