"""Embedding requests as Skulk validates them: OpenAI's `POST /v1/embeddings` and Ollama's `/api/embed`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .limits import ContentText, ModelText

MAX_EMBEDDING_INPUTS = 2048
"""Inputs per request, OpenAI's own bound: a node refuses more before any work, naming the limit."""
MAX_INPUT_TOKEN_IDS = 1 << 16
"""Token ids in one token-array input; the model's positions (a few hundred to a few thousand) bound it first."""

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_INPUT_TOKEN_IDS)]
Texts = Annotated[list[ContentText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
TokenRows = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


def _no_blank(value: object) -> object:
    """OpenAI refuses an empty string; so do we, naming which one, rather than embed nothing."""
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for i, text in enumerate(texts):
        if isinstance(text, str) and not text:
            raise ValueError(f"input[{i}] is an empty string; send text to embed" if len(texts) > 1 or
                             isinstance(value, list) else "input is an empty string; send text to embed")
    return value


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request. `input` is a text, a list of texts, or the model's own token ids (one list,
    or a list of lists)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    input: ContentText | Texts | TokenIds | TokenRows
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None

    _check_blank = field_validator("input")(_no_blank)

    def inputs(self) -> list[str] | list[list[int]]:
        """Always a list of inputs: one text or one token list becomes a list of one."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


class OllamaEmbedRequest(BaseModel):
    """Ollama's `/api/embed`: `input` is a text or a list of texts; `truncate` (default true, as in Ollama)
    cuts an input longer than the model's context instead of refusing it."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    input: ContentText | Texts
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None

    _check_blank = field_validator("input")(_no_blank)

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class OllamaLegacyEmbedRequest(BaseModel):
    """Ollama's legacy `/api/embeddings`: one `prompt`, answered as one `embedding` (what older clients and
    `ollama.Client.embeddings` send)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    prompt: Annotated[ContentText, Field(min_length=1)]
