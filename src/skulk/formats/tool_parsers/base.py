"""What every tool-call format shares: a parser is a few pure functions over the reply's text.

A format is read in two steps. `markers` are the texts that open a call section anywhere in a reply (a tag, a
special token); the text before the first one is ordinary content. `bare` says whether a reply with no marker
may still be a call from its first character on (Llama 3's and Mistral's untagged JSON). `split` turns the whole
finished text into (content, calls), or None when it holds no well-formed call: then the whole text stays content,
so malformed call text is never lost and never half-read. While streaming, `complete` reads the calls whose text
has closed so far (a closing marker in `closers`, or a format's own `closed` reader where a call ends with its JSON,
as in Llama 3 and Mistral), so each call can go out as soon as it is whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RawCall = tuple[str, "dict[str, Any] | str"]
"""(function name, arguments): an object as the model wrote it (XML formats: every value a string, coerced later
to the tool's schema), or a string that is not a JSON object (kept as the model wrote it)."""

Split = Callable[[str], "tuple[str, list[RawCall]] | None"]
Closed = Callable[[str], "tuple[int, list[RawCall]]"]
"""(where the last closed call's text ends, the calls closed so far): (0, []) when none is whole yet, or when one
that closed is malformed (the rest is then left to `split` at the end)."""


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One family's tool-call format. `template_marks`: texts whose presence in a chat template says the model
    writes this format (the first parser in the registry whose mark is found wins)."""

    name: str
    markers: tuple[str, ...]
    split: Split
    template_marks: tuple[str, ...] = ()
    bare: Callable[[str], bool] | None = None
    closers: tuple[str, ...] = ()
    closed: Closed | None = None

    def complete(self, text: str) -> tuple[int, list[RawCall]]:
        """The calls in a reply's call text (from its first marker, or the whole of a bare reply) that have closed
        so far, and where the last ends: the format's `closed` reader, else the text up to the last closer, split."""
        if self.closed is not None:
            return self.closed(text)
        return closed_by(self.split, self.closers)(text)


def closed_by(split: Split, closers: tuple[str, ...]) -> Closed:
    """A `closed` reader for formats whose calls each end with a closing marker (`</tool_call>`, a special token):
    the text up to the last closer holds only whole calls, and `split` reads it."""

    def closed(text: str) -> tuple[int, list[RawCall]]:
        end = max((text.rfind(c) + len(c) for c in closers if c in text), default=0)
        found = split(text[:end]) if end else None
        return (end, found[1]) if found is not None else (0, [])

    return closed


def loads(text: str) -> Any:
    """JSON, or None where the text is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def json_call(obj: Any) -> RawCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} (Hermes, Llama 3, Mistral) as a call; None otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return (obj["name"], args) if isinstance(args, (dict, str)) else None


def json_args(text: str) -> dict[str, Any] | str | None:
    """A call's argument text: a JSON object, or None where it is not one (an empty text is no arguments)."""
    if not text.strip():
        return {}
    obj = loads(text)
    return obj if isinstance(obj, dict) else None


def all_or_none(calls: list[RawCall | None]) -> list[RawCall] | None:
    """The calls when every one is well-formed and there is at least one; None otherwise."""
    good = [c for c in calls if c is not None]
    return good if good and len(good) == len(calls) else None


def before(text: str, markers: tuple[str, ...]) -> tuple[str, str] | None:
    """(text before the first marker, the rest from it); None when no marker is in the text."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if not found:
        return None
    at = min(found)
    return text[:at], text[at:]
