"""Server-sent events, framed in one place: every streaming API (OpenAI chat and completions, Claude Messages,
the Responses API) writes its frames with these, so a frame always ends in the blank line clients split on."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
"""OpenAI's end-of-stream sentinel."""


def compact(payload: dict[str, Any]) -> str:
    """JSON without spaces, as OpenAI and Anthropic send it."""
    return json.dumps(payload, separators=(",", ":"))


def frame(data: str, *, event: str | None = None) -> str:
    """One event: `data` is the already serialized payload (one line), `event` its name where the API names
    events (Claude, Responses)."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n"


def data(payload: dict[str, Any]) -> str:
    """An unnamed event with a JSON payload (OpenAI's chunks)."""
    return frame(compact(payload))


def comment(text: str) -> str:
    """A comment line, which clients that do not know it skip (Skulk's `: generation_stats {...}`)."""
    return f": {text}\n\n"
