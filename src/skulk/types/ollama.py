"""Ollama API requests as Skulk validates them (mounted under /ollama, as Skulk mounts them)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from skulk.types.limits import ModelText

from .chat import ChatMessage, FunctionCall, MaxTokens, Seed, Temperature, Tool, ToolCall, TopK, TopLogprobs, TopP


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class OllamaOptions(_Loose):
    num_predict: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None


class OllamaFunction(_Loose):
    name: str = Field(min_length=1, max_length=256)
    arguments: dict[str, Any] | str = {}


class OllamaToolCall(_Loose):
    function: OllamaFunction


class OllamaMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = Field(default=None, max_length=128)

    def to_chat(self, index: int) -> ChatMessage:
        """Ollama's calls carry no ids: each gets one from its position, which is all a template needs."""
        calls = [
            ToolCall(id=f"call_{index}_{i}",
                     function=FunctionCall(name=c.function.name, arguments=_text(c.function.arguments)))
            for i, c in enumerate(self.tool_calls or [])
        ]
        return ChatMessage(role=self.role, content=self.content, tool_calls=calls or None)


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

    def chat_messages(self) -> list[ChatMessage]:
        return [m.to_chat(i) for i, m in enumerate(self.messages)]


class OllamaGenerateRequest(_Loose):
    """The prompt goes to the model as one user message through its chat template (`raw` is not supported)."""

    model: ModelText
    prompt: str = Field(min_length=1)
    system: str | None = None
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["json", ""] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    def chat_messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=self.system)] if self.system else []
        return [*head, ChatMessage(role="user", content=self.prompt)]


class OllamaShowRequest(_Loose):
    model: ModelText | None = None
    name: ModelText | None = None
