"""Ollama API requests as Skulk validates them (mounted under /ollama, as Skulk mounts them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatMessage, MaxTokens, Seed, Temperature, TopK, TopP


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class OllamaOptions(_Loose):
    num_predict: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None


class OllamaMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""


class OllamaChatRequest(_Loose):
    model: str = Field(min_length=1)
    messages: list[OllamaMessage] = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["json", ""] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def chat_messages(self) -> list[ChatMessage]:
        return [ChatMessage(role=m.role, content=m.content) for m in self.messages]


class OllamaGenerateRequest(_Loose):
    """The prompt goes to the model as one user message through its chat template (`raw` is not supported)."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    system: str | None = None
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["json", ""] | dict[str, Any] | None = None

    def chat_messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=self.system)] if self.system else []
        return [*head, ChatMessage(role="user", content=self.prompt)]


class OllamaShowRequest(_Loose):
    model: str | None = None
    name: str | None = None
