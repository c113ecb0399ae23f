"""OpenAI's legacy text completions (POST /v1/completions) and Responses API (POST /v1/responses) requests.

Both reach the model through its chat template: a completion prompt and a Responses `input` string are one user
message, so every model serves them the same way as chat."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from skulk.types.limits import MAX_IMAGE_URL_CHARS, ModelText, refuse_media

from .chat import (
    ChatMessage,
    FunctionCall,
    FunctionSpec,
    ImagePart,
    ImageUrl,
    MaxTokens,
    ResponseFormat,
    Seed,
    StreamOptions,
    Temperature,
    TextPart,
    Tool,
    ToolCall,
    TopLogprobs,
    TopP,
    reasoning_budget_error,
)
from .errors import ApiError, ErrorCode


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class CompletionRequest(_Loose):
    model: ModelText
    prompt: str | list[str]
    max_tokens: MaxTokens = 16
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    """Legacy logprobs: each token's log-probability and this many most likely alternatives (0...5)."""
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is)."""
        if self.suffix:
            return "suffix: fill-in-the-middle is not supported; leave suffix out"
        if self.best_of not in (None, 1):
            return "best_of: one completion per request; leave best_of out or 1"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty, frequency_penalty: repetition penalties are not supported; send 0 or leave out"
        if self.logit_bias:
            return "logit_bias: token biases are not supported; leave logit_bias out"
        return None


class InputText(_Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(_Loose):
    """An image by URL (a data: URL, or file:// under the allowed directory): read by a vision model only."""

    type: Literal["input_image"]
    image_url: str = Field(max_length=MAX_IMAGE_URL_CHARS)


InputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class InputMessage(_Loose):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return refuse_media(content, frozenset({"input_text", "output_text", "text", "input_image"}))

    def to_chat(self) -> ChatMessage:
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        if any(isinstance(p, InputImage) for p in self.content):
            return ChatMessage(role=self.role, content=[
                TextPart(type="text", text=p.text) if isinstance(p, InputText)
                else ImagePart(type="image_url", image_url=ImageUrl(url=p.image_url)) for p in self.content])
        return ChatMessage(role=self.role, content="".join(p.text for p in self.content if isinstance(p, InputText)))


class FunctionCallItem(_Loose):
    """A call the model made, sent back in the next request's input (as the Responses API returned it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = "{}"
    id: str | None = None


class FunctionCallOutputItem(_Loose):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str


class ReasoningItem(_Loose):
    """An earlier reply's reasoning, sent back in the input as the Responses API returned it: accepted and left
    out of the prompt (thinking templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    """Easy input messages may leave out "type": they are messages."""
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Loose):
    """A Responses API function tool (flat: name and parameters beside type, unlike chat's nested function)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> Tool:
        return Tool(function=FunctionSpec(name=self.name, description=self.description, parameters=self.parameters))


class NamedFunction(_Loose):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class TextFormat(_Loose):
    """Responses' `text.format`: plain text, any JSON, or JSON that follows a schema (decoding is constrained to
    it, as chat's response_format is)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def to_chat(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        spec = {"name": self.name, "schema": self.schema_ or {}, "strict": self.strict}
        return ResponseFormat(type="json_schema", json_schema=spec)

    def echo(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ResponseText(_Loose):
    format: TextFormat = TextFormat()


class ResponsesRequest(_Loose):
    """POST /v1/responses. Stateful: `previous_response_id` continues a stored response (api/response_store.py),
    `store: false` keeps this one out of the store. Fields that would change the answer and are not served
    (`background`, `conversation`, `reasoning.summary`, `prompt`) are refused by `unsupported`, not ignored.
    `reasoning.effort` reaches the chat template as reasoning_effort; `reasoning.max_tokens` caps the reasoning."""

    model: ModelText
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    """Only function tools are served; checked by `function_tools` (a 400 naming any other type)."""
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    top_logprobs: TopLogprobs | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    store: bool = True
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    text: ResponseText | None = None
    background: bool = False
    conversation: Any = None
    reasoning: dict[str, Any] | None = None
    prompt: Any = None

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is)."""
        if self.background:
            return "background: responses run in the foreground only; leave background out or false"
        if self.conversation is not None:
            return "conversation: conversations are not stored; continue a response with previous_response_id"
        if (self.reasoning or {}).get("summary") not in (None, "auto"):
            return ("reasoning.summary: reasoning is returned as it was written, not summarised; leave summary out "
                    'or "auto"')
        if self.prompt is not None:
            return "prompt: stored prompt templates are not supported; send instructions and input"
        return None

    def wants_logprobs(self) -> bool:
        """Logprobs are asked for with include "message.output_text.logprobs" (or by asking for alternatives)."""
        return "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None

    def chat_messages(self, history: list[ChatMessage] | None = None) -> list[ChatMessage]:
        """The instructions, the earlier turns (`history`, from previous_response_id), then the input."""
        head = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        return [*head, *(history or []), *self.input_messages()]

    def reasoning_effort(self) -> str | None:
        effort = (self.reasoning or {}).get("effort")
        return effort if isinstance(effort, str) else None

    def reasoning_budget(self) -> int | None:
        """`reasoning.max_tokens` (OpenRouter's name for it in the same object; OpenAI's Responses has no cap):
        the most tokens the reasoning may take, as chat's `reasoning_budget`. A 400 for anything but an integer
        >= 1."""
        value = (self.reasoning or {}).get("max_tokens")
        if (why := reasoning_budget_error(value, 'reasoning.effort "none"')) is not None:
            raise ApiError(ErrorCode.invalid_request, f"reasoning.max_tokens: {why}")
        return value

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages: an assistant message and the function calls after it become one assistant
        turn with tool_calls, each output a tool message."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append(item.to_chat())
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            elif isinstance(item, FunctionCallItem):
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":  # the same turn's text and earlier calls
                    messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
                else:
                    messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        return messages

    def chat_tool_choice(self) -> Literal["none", "auto", "required"] | dict[str, Any] | None:
        """The tool choice in chat's shape."""
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice
