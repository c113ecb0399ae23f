"""Tools for a chat template that has no tools section: rendered into the system message, never dropped.

Many small instruct models (SmolLM2, Gemma 3's hub template among others) ship templates that ignore `tools`, so
a request's tools would reach the model as nothing at all. Such a template gets them in the system message in the
Hermes convention Qwen's templates use (the format is fixed and documented here and in the README):

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {...}}      (one line per tool, OpenAI's JSON)
    </tools>

    For each function call, return a json object with function name and arguments within <tool_call></tool_call>
    XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

The reply is parsed back by api/tool_calls.py (Hermes tags are read for every family), and earlier turns keep
the same convention: an assistant's calls become <tool_call> blocks in its content, a tool's result a user turn
wrapped in <tool_response>. A forced call is constrained to this format too (engines/constrained.py)."""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)
PROBE_TOOL = {"type": "function", "function": {"name": "skulk_probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}


def tools_block(tools: list[dict[str, Any]]) -> str:
    lines = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages (tokenizer.template_messages) with the tools in the system message and tool turns in
    the Hermes convention, for a template that renders no tools."""
    out: list[dict[str, Any]] = []
    for item in messages:
        if item.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in item["tool_calls"])
            content = f"{item.get('content') or ''}\n{calls}".strip()
            out.append({"role": "assistant", "content": content})
        elif item.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{item.get('content') or ''}\n</tool_response>"})
        else:
            out.append(dict(item))
    block = tools_block(tools)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": block})
    return _merge_users(out)


def _merge_users(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns (several tool results) as one, for templates that insist on alternating roles."""
    merged: list[dict[str, Any]] = []
    for item in messages:
        if merged and item["role"] == "user" and merged[-1]["role"] == "user":
            merged[-1] = {**merged[-1], "content": f"{merged[-1]['content']}\n{item['content']}"}
        else:
            merged.append(item)
    return merged
