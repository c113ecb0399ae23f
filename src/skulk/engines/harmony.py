"""gpt-oss's harmony channels split into reasoning and content, incrementally (engines/reasoning.py picks it).

A reply is a run of messages, each a header and a body: `<|channel|>analysis<|message|>…<|end|>` is reasoning,
`<|start|>assistant<|channel|>final<|message|>…` the answer, and `commentary` without a recipient a preamble the
user sees (content). A message to a recipient (`… to=functions.f <|constrain|>json<|message|>{…}`) is a tool call:
it goes on as content, header and all, for the API's harmony tool parser (tool_parsers/special_tokens.py),
which holds it back. `<|end|>` ends a message; `<|return|>` and `<|call|>` end the turn (end-of-turn tokens the
engine does not decode, read here if they show). Text with no header at all is content.

Pure: no I/O; nothing is held back longer than a header (until its `<|message|>`) or what could still be the
start of a tag."""

from __future__ import annotations

import re
from typing import Literal

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_BREAKS = (*ENDS, START, CHANNEL)
_MAX_HEADER = 512
"""A header longer than this without its `<|message|>` is not one: it goes out as content."""
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"(\w+)")

HarmonyState = Literal["start", "header", "reasoning", "content", "call"]


def _tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a beginning of one of the tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def route(header: str) -> HarmonyState:
    """Where a message's body goes, from its header: a recipient makes it a call; analysis is reasoning."""
    if " to=" in header or header.startswith("to="):
        return "call"
    name = _CHANNEL_NAME.search(header)
    return "reasoning" if name is not None and name.group(1) == "analysis" else "content"


class HarmonySplitter:
    """Text pieces in, (reasoning, content) deltas out, as engines/reasoning.ReasoningSplitter (its `state` and
    `in_reasoning` are what api/generation.py reads to count reasoning tokens)."""

    def __init__(self) -> None:
        self.state: HarmonyState = "start"
        self.held = ""

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def push(self, text: str) -> tuple[str, str]:
        buffer, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buffer:
            if self.state == "call":  # a tool call runs to the end of the turn: all of it for the tool parser
                content.append(buffer)
                break
            if self.state in ("start", "header"):
                buffer, out = self._header(buffer)
                content.append(out)
                continue
            buffer = self._body(buffer, reasoning if self.state == "reasoning" else content)
        return "".join(reasoning), "".join(content)

    def _header(self, buffer: str) -> tuple[str, str]:
        """(what is left after the header, content to send); holds a header not complete yet."""
        if buffer.startswith((START, CHANNEL)):
            at = buffer.find(MESSAGE)
            if at < 0 and len(buffer) <= _MAX_HEADER:
                self.held = buffer
                return "", ""
            if at >= 0:
                header, rest = buffer[: at + len(MESSAGE)], buffer[at + len(MESSAGE):]
                self.state = route(header)
                return rest, header if self.state == "call" else ""
        elif any(t.startswith(buffer) for t in (START, CHANNEL)):
            self.held = buffer
            return "", ""
        self.state = "content"  # no header: plain text
        return buffer, ""

    def _body(self, buffer: str, out: list[str]) -> str:
        """Sends the body up to its end (dropped) or the next header (kept); returns what is left."""
        found = [(i, t) for t in _BREAKS if (i := buffer.find(t)) >= 0]
        if found:
            at, tag = min(found)
            out.append(buffer[:at])
            self.state = "header"
            return buffer[at + len(tag):] if tag in ENDS else buffer[at:]
        cut = len(buffer) - _tag_prefix(buffer, _BREAKS)
        out.append(buffer[:cut])
        self.held = buffer[cut:]
        return ""

    def finish(self) -> tuple[str, str]:
        """What is still held when the reply ends: a tag begun in a body is text of its side; a header never
        finished is content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
