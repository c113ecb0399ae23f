"""A model's tool-call text turned into OpenAI `tool_calls`, in the model's own format.

The formats and how one is picked are in tool_parsers/ (one registry: Hermes/Qwen JSON, Qwen3-Coder XML,
Llama 3 JSON, Mistral `[TOOL_CALLS]`, DeepSeek V3.1, Kimi K2, GLM-4.5, gpt-oss harmony). This module applies one
to a reply: to the finished text (`parse_tool_calls`), and while streaming (`ToolCallStream`), where text is
held back only as long as it could still be the start of a call in that format (`could_be_tool_call`), so a half
call never goes out as text and plain answers stream as before; each call goes out as soon as its text closes
(`ToolCallStream.take`, the parser's `complete`), the rest at the end. Arguments are coerced to the tools' schemas.

Pure functions and a small stateful splitter; no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from skulk.formats.tool_parsers import RawCall, ToolParser, coerce_arguments, parser_for
from skulk.types.chat import FunctionCall, ToolCall


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one request's reply is read: the parser (a registry name, or a family name that picks one) and the
    offered tools' parameter schemas by function name (for coercing arguments)."""

    parser: str
    schemas: dict[str, Any] = field(default_factory=dict)


ToolSpec = ToolFormat | str
"""A ToolFormat, or just a parser or family name (no coercion)."""


def _format(spec: ToolSpec) -> tuple[ToolParser, dict[str, Any]]:
    if isinstance(spec, ToolFormat):
        return parser_for(spec.parser), spec.schemas
    return parser_for(spec), {}


def _tool_call(raw: RawCall, index: int, call_id: str, schemas: dict[str, Any]) -> ToolCall:
    name, args = raw
    if isinstance(args, dict):
        args = json.dumps(coerce_arguments(args, schemas.get(name)), separators=(",", ":"), ensure_ascii=False)
    return ToolCall(id=f"call_{call_id}_{index}", function=FunctionCall(name=name, arguments=args))


def parse_tool_calls(spec: ToolSpec, text: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """(content left over, tool calls); no calls, and all the text as content, when the text holds no
    well-formed call in the format."""
    parser, schemas = _format(spec)
    found = parser.split(text)
    if found is None:
        return text, []
    content, raws = found
    return content, [_tool_call(r, i, call_id, schemas) for i, r in enumerate(raws)]


def _marker_at(parser: ToolParser, text: str) -> int:
    """Where the first call marker starts in text (-1: none)."""
    found = [i for i in (text.find(m) for m in parser.markers) if i >= 0]
    return min(found) if found else -1


def could_be_tool_call(spec: ToolSpec, text: str) -> bool:
    """Whether a reply that starts with `text` might still turn out to be a tool call (then it is held back)."""
    parser, _ = _format(spec)
    head = text.lstrip()
    if not head or _marker_at(parser, head) >= 0 or any(m.startswith(head) for m in parser.markers):
        return True
    return parser.bare is not None and parser.bare(head)


def _prefix_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a beginning of a marker (it may still become one)."""
    best = 0
    for tag in markers:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ToolCallStream:
    """Splits streamed text into content that can go out now, tool calls whose text has closed (`take`), and a held
    tail that may still be (part of) a call. Call indexes and ids run on over the whole reply, so a call taken
    early and one found at the end are numbered as `parse_tool_calls` numbers them."""

    def __init__(self, spec: ToolSpec, *, hold_all: bool = False) -> None:
        """hold_all: nothing streams, the whole reply is parsed at the end (a tool call was forced, and a call of
        the wrong tool must turn into an error, not go out first)."""
        self.spec = spec
        self.parser, self.schemas = _format(spec)
        self.held = ""
        self.started = False  # some content went out: an untagged (Llama, Mistral) call is no longer possible
        self.capturing = hold_all
        self.hold_all = hold_all
        self.sent: list[ToolCall] = []
        self.end = 0  # where in `held` the text of the calls sent so far ends
        self.looked = 0  # how much of `held` `take` has looked at for a closer

    def push(self, text: str) -> str:
        self.held += text
        if self.capturing:
            return ""
        at = _marker_at(self.parser, self.held)
        if at >= 0:
            out, self.held, self.capturing, self.looked = self.held[:at], self.held[at:], True, 0
            return self._send(out)
        if not self.started and could_be_tool_call(self.spec, self.held):
            return ""
        keep = _prefix_tail(self.held, self.parser.markers)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return self._send(out)

    def _send(self, out: str) -> str:
        self.started = self.started or bool(out.strip())
        return out

    def take(self, call_id: str) -> list[ToolCall]:
        """The calls whose text closed since the last take, each once (none while a forced call is held whole)."""
        if self.hold_all or (self.started and not self.capturing) or not self._may_have_closed():
            return []
        end, raws = self.parser.complete(self.held)
        if len(raws) <= len(self.sent):
            return []
        new = [_tool_call(r, i, call_id, self.schemas) for i, r in enumerate(raws) if i >= len(self.sent)]
        self.sent, self.end, self.capturing = [*self.sent, *new], end, True  # a bare reply is now a call
        return new

    def _may_have_closed(self) -> bool:
        """Whether a closer arrived since the last look (formats read by closers: the text up to the last one is
        parsed only then, not at every token); always for formats whose calls end with their JSON."""
        if self.parser.closed is not None:
            return True
        since, self.looked = self.looked, len(self.held)
        start = max(0, since - max((len(c) for c in self.parser.closers), default=0))
        return any(c in self.held[start:] for c in self.parser.closers)

    def finish(self, call_id: str) -> tuple[str, list[ToolCall]]:
        """(content still to send, the tool calls not taken yet) once the generation ended. After calls went out,
        a malformed rest is content, as a whole malformed reply is."""
        if self.started and not self.capturing:
            return self.held, []
        content, calls = parse_tool_calls(self.spec, self.held, call_id)
        if not self.sent:
            return content, calls
        if len(calls) >= len(self.sent):
            return content, calls[len(self.sent):]
        rest = self.held[self.end:]
        return (rest if rest.strip() else ""), []


def openai_tool_calls(calls: list[ToolCall], start: int = 0) -> list[dict[str, Any]]:
    """Calls as an OpenAI streaming delta carries them (each with its index in the reply, from `start`) or a
    message lists them."""
    return [{"index": i, **call.model_dump(mode="json")} for i, call in enumerate(calls, start)]
