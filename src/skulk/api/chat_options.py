"""What a chat request asks beyond messages and sampling, decided before it is sent: one choice, logprobs only
when asked for properly, JSON output asked for in the prompt, the tool choice, and whether the reply is parsed for
tool calls (and how: the model family's format).

`response_format` and a forced `tool_choice` become a system line (and, for a named function, the only tool the
template sees), and the request's sampling carries them as an OutputConstraint that the engine enforces on every
token (engines/constrained.py): the JSON always parses and validates, a forced call is always a well-formed call to
an offered tool. The reply is still checked (`unmet_tool_choice`): only a reply cut short by max_tokens can break
it now, answered with a non-retryable 422, since the same request would be cut short again."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from skulk.api.model_facts import model_dir
from skulk.api.ollama_show import TEMPLATE_FILES, chat_template_text
from skulk.api.services import ApiServices
from skulk.api.tool_calls import ToolFormat
from skulk.formats.tool_parsers import pick_parser
from skulk.state.queries import card_of
from skulk.types.chat import ChatCompletionRequest, ChatMessage, ToolCall
from skulk.types.errors import ApiError, ErrorCode

UNMET_STATUS = ErrorCode.tool_choice_unmet.status
"""A forced tool choice the reply does not keep: not retryable (SDKs retry 5xx; the same request fails the same)."""
JSON_INSTRUCTION = "Respond with one valid JSON object and nothing else."
ANY_TOOL_INSTRUCTION = "You must answer by calling one of the tools offered, not with text."


def check_supported(request: ChatCompletionRequest) -> None:
    if (why := request.unsupported()) is not None:
        raise ApiError(ErrorCode.unsupported_field, why)
    if request.n is not None and request.n != 1:
        raise ApiError(ErrorCode.invalid_request,
                       f"n: only n=1 is supported (one choice per request), got {request.n}; "
                       "send n separate requests instead")
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(ErrorCode.invalid_request,
                       "top_logprobs: set logprobs to true as well (top_logprobs says how many alternatives "
                       "each token's logprobs list)")
    forced_tool(request)


def forced_tool(request: ChatCompletionRequest) -> str | None:
    """None: the model may answer in text; "": it must call some tool; a name: it must call that function.
    A 400 for a tool choice that cannot be met (no tools, an unknown name, a shape OpenAI does not define)."""
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not request.tools:
        raise ApiError(ErrorCode.invalid_request,
                       "tool_choice: forcing a tool call needs tools; send tools or drop tool_choice")
    if choice == "required":
        return ""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(ErrorCode.invalid_request,
                       'tool_choice: "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}')
    if name not in {t.function.name for t in request.tools}:
        raise ApiError(ErrorCode.invalid_request, f"tool_choice: function {name!r} is not among the tools sent")
    return name


def prepared(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request as the engine gets it: the JSON and tool-choice instructions first, a named function the only
    tool offered."""
    lines: list[str] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        lines.append(JSON_INSTRUCTION)
        schema = fmt.json_schema.get("schema") if fmt.json_schema else None
        if schema is not None:
            lines.append(f"It must match this JSON schema: {json.dumps(schema, separators=(',', ':'))}")
    update: dict[str, object] = {}
    forced = forced_tool(request)
    if forced:
        update["tools"] = [t for t in request.tools or [] if t.function.name == forced][:1]
        lines.append(f"You must answer by calling the function {forced}, not with text.")
    elif forced == "":
        lines.append(ANY_TOOL_INSTRUCTION)
    if lines:
        update["messages"] = _with_system_line(request.messages, " ".join(lines))
    return request.model_copy(update=update) if update else request


def _with_system_line(messages: list[ChatMessage], line: str) -> list[ChatMessage]:
    """The line first in the conversation's own system message (templates that take one system message, or
    only one at the start, see one), else in a new one."""
    head = messages[0]
    if head.role in ("system", "developer") and not head.tool_calls:
        return [head.model_copy(update={"content": f"{line}\n\n{head.text}"}), *messages[1:]]
    return [ChatMessage(role="system", content=line), *messages]


def unmet_tool_choice(forced: str | None, calls: list[ToolCall]) -> str | None:
    """Why a finished reply breaks a forced tool choice (None when it keeps it)."""
    if forced is None:
        return None
    if not calls:
        return ("tool_choice: the reply holds no complete tool call (the call is constrained, so max_tokens ended "
                "it first, or the model answered in text on an engine without constraints); raise max_tokens")
    wrong = sorted({c.function.name for c in calls} - {forced}) if forced else []
    if wrong:
        return f"tool_choice: the model called {', '.join(wrong)}, not {forced}"
    return None


def tool_family(node: ApiServices, request: ChatCompletionRequest) -> ToolFormat | None:
    """How the reply's tool calls are read (tool_parsers/): the card's `tool_parser`, else the markers of the
    chat template on this node, else the family name; with the offered tools' schemas. None: no tools offered."""
    if not request.tools or request.tool_choice == "none":
        return None
    schemas = {t.function.name: t.function.parameters for t in request.tools if t.function.parameters}
    card = card_of(node.state, request.model)
    if card is None:
        return ToolFormat("", schemas)
    template = "" if card.tool_parser is not None else _template_of(model_dir(node, card))
    return ToolFormat(pick_parser(template, card.family, card.tool_parser).name, schemas)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _template_of(where: Path | None) -> str:
    """The model's chat template text on this node ("" without a copy), read again only when its files change."""
    if where is None:
        return ""
    return _read_template(str(where), tuple(_mtime(where / n) for n in TEMPLATE_FILES))


@functools.lru_cache(maxsize=32)
def _read_template(where: str, stamps: tuple[int, ...]) -> str:
    return chat_template_text(Path(where))
