"""Anthropic Messages API requests as Skulk validates them (POST /v1/messages, /v1/messages/count_tokens)."""

from __future__ import annotations

import json
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
    Seed,
    Temperature,
    TextPart,
    Tool,
    ToolCall,
    TopK,
    TopP,
)


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageSource(_Block):
    type: Literal["base64", "url"]
    media_type: str = ""
    data: str = Field(default="", max_length=MAX_IMAGE_URL_CHARS)
    url: str = Field(default="", max_length=MAX_IMAGE_URL_CHARS)


class ImageBlock(_Block):
    """An image: a base64 source becomes a data: URL image part (a url source is refused at the API: no network
    fetch); read by a vision model only (api/images.py)."""

    type: Literal["image"]
    source: ImageSource

    def to_part(self) -> ImagePart:
        s = self.source
        url = s.url if s.type == "url" else f"data:{s.media_type or 'image/png'};base64,{s.data}"
        return ImagePart(type="image_url", image_url=ImageUrl(url=url))


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = {}


class ThinkingBlock(_Block):
    """An earlier turn's thinking, sent back as the client received it: accepted and left out of the prompt
    (thinking templates drop earlier turns' reasoning too)."""

    type: Literal["thinking", "redacted_thinking"]


TEXT_BLOCKS = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking"})
MESSAGE_BLOCKS = TEXT_BLOCKS | {"image"}
"""A message's blocks: an image is read by a vision model (api/images.py); a tool result's stay text only."""


def _text_only(content: Any) -> Any:
    return refuse_media(content, TEXT_BLOCKS)


def _images_or_text(content: Any) -> Any:
    return refuse_media(content, MESSAGE_BLOCKS)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    _media = field_validator("content", mode="before")(_text_only)


def _block_type(value: Any) -> str:
    return value.get("type", "") if isinstance(value, dict) else getattr(value, "type", "")


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class ClaudeMessage(_Block):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    _media = field_validator("content", mode="before")(_images_or_text)

    def to_chat(self) -> list[ChatMessage]:
        """Text blocks join into one message with the turn's tool uses as its tool calls; each tool result becomes
        a `tool` message naming its call, as OpenAI-style chat templates expect."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        out: list[ChatMessage] = []
        text: list[str] = []
        parts: list[TextPart | ImagePart] = []  # text and images in order, where the turn has images
        calls: list[ToolCall] = []
        for block in self.content:
            if isinstance(block, TextBlock):
                text.append(block.text)
                parts.append(TextPart(type="text", text=block.text))
            elif isinstance(block, ImageBlock):
                parts.append(block.to_part())
            elif isinstance(block, ToolUseBlock):
                calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                         arguments=json.dumps(block.input))))
            elif isinstance(block, ToolResultBlock):
                body = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
                out.append(ChatMessage(role="tool", content=body, tool_call_id=block.tool_use_id))
        if len(parts) > len(text):
            out.insert(0, ChatMessage(role=self.role, content=parts, tool_calls=calls or None))
        elif text or calls:
            out.insert(0, ChatMessage(role=self.role, content="".join(text), tool_calls=calls or None))
        return out


class ClaudeTool(_Block):
    type: str | None = None
    """None or "custom": a tool the client runs. Anthropic's server tools (web_search_…, bash_…) are refused."""
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = {}

    def to_openai(self) -> Tool:
        return Tool(function=FunctionSpec(name=self.name, description=self.description, parameters=self.input_schema))


class ClaudeToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ClaudeThinking(_Block):
    """Extended thinking: enabled (the template's thinking switch on, the reasoning capped at budget_tokens),
    adaptive (on, no cap) or disabled (the template's switch off)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)

    def template_switch(self) -> bool:
        return self.type != "disabled"


class ClaudeRequest(BaseModel):
    """The body of POST /v1/messages. `metadata` (a user id for Anthropic's abuse checks) is accepted and unused;
    what would change the answer and is not served (server tools, MCP servers, containers) is refused
    by `unsupported` with a 400 rather than silently ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    messages: list[ClaudeMessage] = Field(min_length=1)
    max_tokens: MaxTokens
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=4)
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    tools: list[ClaudeTool] | None = Field(default=None, max_length=128)
    tool_choice: ClaudeToolChoice | None = None
    thinking: ClaudeThinking | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is)."""
        if self.thinking is not None and self.thinking.type == "enabled" and self.thinking.budget_tokens is None:
            return 'thinking: {"type": "enabled"} needs budget_tokens (the most tokens the reasoning may take)'
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                return (f"tools.{i}: {tool.type!r} is one of Anthropic's server tools, which Skulk does not run; "
                        "send custom tools (name, description, input_schema) only")
        if self.mcp_servers:
            return "mcp_servers: MCP connectors are not supported; leave mcp_servers out"
        if self.container is not None:
            return "container: code execution containers are not supported; leave container out"
        return None

    def chat_messages(self) -> list[ChatMessage]:
        system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system or [])
        head = [ChatMessage(role="system", content=system)] if system else []
        return head + [m for message in self.messages for m in message.to_chat()]


class ClaudeCountRequest(BaseModel):
    """POST /v1/messages/count_tokens: what shapes the prompt of a /v1/messages request (no max_tokens). Tools,
    tool_choice and thinking are rendered into the prompt as a request's are, so they are counted too."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    messages: list[ClaudeMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ClaudeTool] | None = Field(default=None, max_length=128)
    tool_choice: ClaudeToolChoice | None = None
    thinking: ClaudeThinking | None = None

    def as_request(self) -> ClaudeRequest:
        """The /v1/messages request this count stands for (one token asked: the prompt is what is counted)."""
        return ClaudeRequest.model_validate(self.model_dump() | {"max_tokens": 1})
