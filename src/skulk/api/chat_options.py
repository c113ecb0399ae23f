"""What a chat request asks beyond messages and sampling, decided before it is sent: one choice, no logprobs
(this engine does not return them yet), JSON output asked for in the prompt, and whether the reply is parsed for
tool calls (and how: the model family's format)."""

from __future__ import annotations

from skulk.api.errors import ApiError
from skulk.api.handle import NodeHandle
from skulk.models.cards import get_card
from skulk.types.chat import ChatCompletionRequest, ChatMessage
from skulk.types.ids import ModelId

JSON_INSTRUCTION = "Respond with one valid JSON object and nothing else."


def check_supported(request: ChatCompletionRequest) -> None:
    if request.n is not None and request.n != 1:
        raise ApiError(400, f"n: only n=1 is supported (one choice per request), got {request.n}; "
                       "send n separate requests instead", code="invalid_request")
    if request.logprobs or request.top_logprobs:
        raise ApiError(400, "logprobs/top_logprobs: this engine does not return log probabilities yet; drop them",
                       code="invalid_request")
    if request.tool_choice == "required" or isinstance(request.tool_choice, dict):
        raise ApiError(400, "tool_choice: only \"auto\" and \"none\" are supported (the model decides whether to "
                       "call a tool; nothing forces it)", code="invalid_request")


def with_response_format(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """json_object/json_schema: a system line asking for JSON (and the schema) goes first; decoding is not
    constrained, so a model may still answer otherwise."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return request
    line = JSON_INSTRUCTION
    if fmt.type == "json_schema" and fmt.json_schema:
        line += f" It must match this JSON schema: {fmt.json_schema}"
    messages = [ChatMessage(role="system", content=line), *request.messages]
    return request.model_copy(update={"messages": messages})


def tool_family(node: NodeHandle, request: ChatCompletionRequest) -> str | None:
    """The model family whose tool-call format the reply is parsed with; None when no tools are offered."""
    if not request.tools or request.tool_choice == "none":
        return None
    card = get_card(request.model) or node.state.model_cards.get(ModelId(request.model))
    return card.family if card is not None else ""
