"""A model's tool-call text turned into OpenAI `tool_calls`, per model family.

- Qwen (and other ChatML/Hermes-style templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text before the first one is ordinary content.
- Llama 3: the whole reply is one JSON object `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), or several separated by `;`.
- Mistral (v3 tokenizers: Mistral 7B v0.3, Mixtral, Nemo): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`,
  one JSON list. `[TOOL_CALLS]` is a special token that decoding drops, so the bare list counts too.

Pure functions: the API applies them to the finished text and, while streaming, holds text back only as long as
it could still be the start of a tool call (`could_be_tool_call`), so plain answers stream as before."""

from __future__ import annotations

import json
import re
from typing import Any

from skulk.types.chat import FunctionCall, ToolCall

QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_QWEN = re.compile(re.escape(QWEN_OPEN) + r"\s*(.*?)\s*" + re.escape(QWEN_CLOSE), re.DOTALL)


def uses_json_calls(family: str) -> bool:
    """Llama 3's templates ask for bare JSON objects; Qwen and the other ChatML families use Hermes tags."""
    return family.lower().startswith("llama")


def uses_list_calls(family: str) -> bool:
    """Mistral's templates show the model a JSON list of calls after `[TOOL_CALLS]`."""
    return family.lower().startswith("mistral")


def _call(obj: Any, index: int, call_id: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, separators=(",", ":"))
    return ToolCall(id=f"call_{call_id}_{index}", function=FunctionCall(name=obj["name"], arguments=arguments))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(family: str, text: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """(content left over, tool calls); no calls when the text is not a well-formed tool call."""
    if QWEN_OPEN in text:
        calls = [_call(_loads(body), i, call_id) for i, body in enumerate(_QWEN.findall(text))]
        if calls and all(c is not None for c in calls):
            return text[: text.index(QWEN_OPEN)].strip(), [c for c in calls if c is not None]
        return text, []
    if uses_json_calls(family):
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        parts = [_loads(p) for p in body.split(";")] if body.startswith("{") else []
        calls = [_call(p, i, call_id) for i, p in enumerate(parts)]
        if calls and all(c is not None for c in calls):
            return "", [c for c in calls if c is not None]
    if uses_list_calls(family):
        body = _loads(text.strip().removeprefix(MISTRAL_TAG).strip())
        calls = [_call(p, i, call_id) for i, p in enumerate(body)] if isinstance(body, list) else []
        if calls and all(c is not None for c in calls):
            return "", [c for c in calls if c is not None]
    return text, []


def could_be_tool_call(family: str, text: str) -> bool:
    """Whether streamed text so far might still turn out to be a tool call (then it is held back)."""
    head = text.lstrip()
    if not head:
        return True
    if QWEN_OPEN in head or QWEN_OPEN.startswith(head[: len(QWEN_OPEN)]):
        return True
    if uses_list_calls(family):
        return head.startswith("[")  # the list itself, or [TOOL_CALLS] kept by a tokenizer that shows it
    return uses_json_calls(family) and (head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head))


def _prefix_tail(text: str, tag: str) -> int:
    """Length of the longest end of text that is a beginning of tag (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStream:
    """Splits streamed text into content that can go out now and a held tail that may be a tool call."""

    def __init__(self, family: str, *, hold_all: bool = False) -> None:
        """hold_all: nothing streams, the whole reply is parsed at the end (a tool call was forced)."""
        self.family = family
        self.held = ""
        self.started = False  # some content went out: an untagged (Llama, Mistral) call is no longer possible
        self.capturing = hold_all

    def push(self, text: str) -> str:
        self.held += text
        if self.capturing:
            return ""
        at = self.held.find(QWEN_OPEN)
        if at >= 0:
            out, self.held, self.capturing = self.held[:at], self.held[at:], True
            return self._send(out)
        if not self.started and could_be_tool_call(self.family, self.held):
            return ""
        keep = _prefix_tail(self.held, QWEN_OPEN)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return self._send(out)

    def _send(self, out: str) -> str:
        self.started = self.started or bool(out.strip())
        return out

    def finish(self, call_id: str) -> tuple[str, list[ToolCall]]:
        """(content still to send, tool calls) once the generation ended."""
        if self.started and not self.capturing:
            return self.held, []
        return parse_tool_calls(self.family, self.held, call_id)


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as one OpenAI streaming delta carries them (each with its index) or a message lists them."""
    return [{"index": i, **call.model_dump(mode="json")} for i, call in enumerate(calls)]
