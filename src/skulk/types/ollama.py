"""Ollama API requests as Skulk validates them (mounted under /ollama, as Skulk mounts them)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from skulk.types.limits import MAX_IMAGE_URL_CHARS, ModelText

from .chat import (
    ChatMessage,
    FunctionCall,
    ImagePart,
    ImageUrl,
    MaxTokens,
    Seed,
    Temperature,
    TextPart,
    Tool,
    ToolCall,
    TopK,
    TopLogprobs,
    TopP,
    reasoning_budget_error,
)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class OllamaOptions(_Loose):
    num_predict: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    reasoning_budget: int | None = None
    """Skulk's own option (Ollama has none): the most tokens the reasoning may take, its tags included; the engine
    then closes it and the model answers (chat's `reasoning_budget`, Claude's `thinking.budget_tokens`). An option,
    beside `num_predict`, the cap on the whole reply."""

    @field_validator("reasoning_budget", mode="before")
    @classmethod
    def _a_budget(cls, value: Any) -> Any:
        if (why := reasoning_budget_error(value, '"think": false')) is not None:
            raise PydanticCustomError("reasoning_budget", "{why}", {"why": why})
        return value

    def unsupported(self) -> str | None:
        """A sampling option that would change the answer and that Skulk's sampler does not have (None: none is
        set). Options about memory and threads (num_ctx, num_gpu, num_thread, ...) change nothing a client sees
        and are accepted."""
        if self.repeat_penalty not in (None, 1.0) or self.presence_penalty or self.frequency_penalty:
            return "options: repetition penalties are not supported; leave repeat_penalty at 1 and the others at 0"
        if self.min_p or self.typical_p not in (None, 1.0) or self.mirostat:
            return "options: min_p, typical_p and mirostat are not supported; use temperature, top_k and top_p"
        return None


class OllamaFunction(_Loose):
    name: str = Field(min_length=1, max_length=256)
    arguments: dict[str, Any] | str = {}


class OllamaToolCall(_Loose):
    function: OllamaFunction


class OllamaMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = Field(default=None, max_length=128)
    images: list[Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)]] | None = None
    """Base64 pictures, read before the text by a vision model (api/images.py; any other answers text_only)."""

    def to_chat(self, index: int) -> ChatMessage:
        """Ollama's calls carry no ids: each gets one from its position, which is all a template needs."""
        calls = [
            ToolCall(id=f"call_{index}_{i}",
                     function=FunctionCall(name=c.function.name, arguments=_text(c.function.arguments)))
            for i, c in enumerate(self.tool_calls or [])
        ]
        if self.images:
            return ChatMessage(role=self.role, content=image_parts(self.images, self.content), tool_calls=calls or None)
        return ChatMessage(role=self.role, content=self.content, tool_calls=calls or None)


def image_parts(images: list[str], text: str) -> list[TextPart | ImagePart]:
    """Ollama's images (base64) as image parts before the message's text."""
    parts: list[TextPart | ImagePart] = [
        ImagePart(type="image_url", image_url=ImageUrl(url=f"data:image/png;base64,{b}")) for b in images]
    return [*parts, TextPart(type="text", text=text)] if text else parts


def _text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class OllamaChatRequest(_Loose):
    model: ModelText
    messages: list[OllamaMessage] = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["json", ""] | dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    think: bool | str | None = None

    def chat_messages(self) -> list[ChatMessage]:
        return [m.to_chat(i) for i, m in enumerate(self.messages)]

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is)."""
        return self.options.unsupported()


def think_kwargs(think: bool | str | None) -> tuple[bool | None, str | None]:
    """Ollama's `think` as the chat template's switches (enable_thinking, reasoning_effort): a bool turns thinking
    on or off; "low" / "medium" / "high" (gpt-oss's levels) turns it on at that effort."""
    if think is None or isinstance(think, bool):
        return think, None
    return True, think


class OllamaGenerateRequest(_Loose):
    """The prompt goes to the model as one user message through its chat template (`raw` is not supported)."""

    model: ModelText
    prompt: str = Field(min_length=1)
    system: str | None = None
    images: list[Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)]] | None = None
    """Base64 pictures, as a message's."""
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["json", ""] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    think: bool | str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is)."""
        if self.raw:
            return "raw: every prompt goes through the model's own chat template; leave raw out or false"
        if self.suffix:
            return "suffix: fill-in-the-middle is not supported; leave suffix out"
        if self.template:
            return "template: the model's own chat template is always used; leave template out"
        if self.context:
            return "context: send the conversation as /api/chat messages instead of a context from an earlier reply"
        return self.options.unsupported()

    def chat_messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=self.system)] if self.system else []
        content = image_parts(self.images, self.prompt) if self.images else self.prompt
        return [*head, ChatMessage(role="user", content=content)]


class OllamaShowRequest(_Loose):
    model: ModelText | None = None
    name: ModelText | None = None
