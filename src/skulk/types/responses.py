"""OpenAI's legacy text completions (POST /v1/completions) and Responses API (POST /v1/responses) requests.

Both reach the model through its chat template: a completion prompt and a Responses `input` string are one user
message, so every model serves them the same way as chat."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatMessage, MaxTokens, Seed, StreamOptions, Temperature, TopP


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class CompletionRequest(_Loose):
    model: str = Field(min_length=1)
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


class InputText(_Loose):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Loose):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def to_chat(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)


class ResponsesRequest(_Loose):
    model: str = Field(min_length=1)
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None

    def chat_messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*head, ChatMessage(role="user", content=self.input)]
        return [*head, *(m.to_chat() for m in self.input)]
