"""An OpenAI-style chat request as Skulk validates it, and the sampling settings the engine takes."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from .base import CamelModel
from .limits import (
    MAX_IMAGE_URL_CHARS,
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    ContentText,
    ModelText,
    NameText,
    StopText,
    refuse_media,
)

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SEED_MAX = 2**64 - 1
TOP_K_MAX = 2**31 - 1
"""The API cannot know a model's vocabulary (model cards do not carry it): top_k is bounded here so it fits any
tensor index, and the engine clamps a top_k above the vocabulary to the vocabulary (which keeps every token)."""

# One bound per sampling field, shared by the request body and the engine's SamplingParams: a value outside
# them once took a whole runner (and every stream in its batch) down.
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=TOP_K_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
ReasoningBudgetTokens = Annotated[int, Field(ge=1, strict=True)]
"""A cap on a reply's reasoning tokens, as the Ollama and Responses APIs take it: a JSON integer >= 1 (strict, so
`true` or `"30"` is refused rather than read as 1 or 30; turning thinking off is each API's own switch, not 0)."""
REASONING_BUDGET_RULE = "an integer >= 1 (the most tokens the reasoning may take, its tags included)"
_BUDGET: TypeAdapter[int] = TypeAdapter(ReasoningBudgetTokens)
RANGES: dict[str, str] = {
    "max_tokens": f"an integer >= 1 and <= {MAX_TOKENS_LIMIT}",
    "max_completion_tokens": f"an integer >= 1 and <= {MAX_TOKENS_LIMIT}",
    "temperature": "a finite number in 0...2",
    "top_p": "a number in (0, 1]",
    "top_k": f"an integer in 0...{TOP_K_MAX} (0 = off; above the vocabulary keeps every token)",
    "seed": f"an integer in 0...{SEED_MAX} (2**64-1)",
}


def _say_range(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """Let pydantic check the bound, then name the field's whole range in the error (the 422 a client sees)."""
    try:
        return handler(value)
    except ValidationError:
        field = info.field_name or "value"
        raise ValueError(f"{field} must be {RANGES[field]}, got {value!r}") from None


def reasoning_budget_error(value: Any, off: str) -> str | None:
    """Why `value` is no reasoning budget (None: it is one, or it is absent), for its API to prefix with the
    field's name; it says how that API turns thinking off (`off`), since 0 is the value a client tries for that."""
    if value is None:
        return None
    try:
        _BUDGET.validate_python(value)
    except ValidationError:
        return f"must be {REASONING_BUDGET_RULE}, got {value!r}; {off} turns thinking off"
    return None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: ContentText


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str = Field(max_length=MAX_IMAGE_URL_CHARS)
    """A data: URL (base64), or a file:// URL under the node's allowed image directory (formats/images.py)."""


class ImagePart(BaseModel):
    """OpenAI's image content part; Anthropic's `image` blocks and Ollama's `images` become one. Read by a
    vision-language model only: any other answers `text_only` (api/chat_session.py)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = "{}"
    """JSON text, as OpenAI sends it."""


class ToolCall(BaseModel):
    """One call the assistant made (in a reply's `tool_calls`, and sent back in the next request's history)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["function"] = "function"
    function: FunctionSpec


class ResponseFormat(BaseModel):
    """`json_object` (and `json_schema`) add one system line asking for JSON; nothing constrains decoding.
    A json_schema must be OpenAI's `{"name", "schema", "strict"?}` with a schema that is a valid JSON Schema."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _valid_schema(self) -> ResponseFormat:
        if self.type != "json_schema":
            return self
        spec = self.json_schema or {}
        name = spec.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
            raise ValueError('json_schema must be {"name": "<1-64 letters, digits, _ or ->", "schema": {...}}')
        schema = spec.get("schema", {})
        if not isinstance(schema, dict) or not isinstance(schema.get("$schema", ""), str):
            raise ValueError("json_schema.schema must be a JSON Schema object (its $schema, if any, a string)")
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"json_schema.schema is not a valid JSON Schema: {exc.message}") from None
        except RecursionError:
            raise ValueError("json_schema.schema is nested too deeply to check") from None
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: ContentText | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: NameText | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        return refuse_media(content, frozenset({"text", "image_url"}))

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def images(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of POST /v1/chat/completions. OpenAI fields Skulk does not serve are refused by `unsupported`
    when they would change the answer; other unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: StopText | list[StopText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    """Choices per request: only 1 is served (the API answers 400 for any other value)."""
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    """Reaches the chat template as `reasoning_effort` (gpt-oss reads it); "none" also turns thinking off."""
    enable_thinking: bool | None = None
    """Reaches the chat template (Qwen3's switch; vLLM and SGLang take it at the top level too)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template, as vLLM takes them."""
    reasoning_budget: int | None = Field(default=None, ge=1)
    """The most tokens the reasoning may take (Claude's `thinking.budget_tokens` arrives here): the engine then
    closes the reasoning and the model answers (SamplingParams.reasoning_budget)."""
    web_search_options: Any = None

    _ranges = field_validator(*RANGES, mode="wrap")(_say_range)

    def unsupported(self) -> str | None:
        """Why a field this request sets is not served (None: every field it sets is). Fields that would change
        the answer are refused rather than ignored; `user`, `metadata`, `store`, `service_tier` change nothing a
        client sees and are accepted."""
        refusals = (
            ("presence_penalty", bool(self.presence_penalty), "repetition penalties are not supported; send 0 or "
             "leave it out"),
            ("frequency_penalty", bool(self.frequency_penalty), "repetition penalties are not supported; send 0 or "
             "leave it out"),
            ("logit_bias", bool(self.logit_bias), "token biases are not supported; leave logit_bias out"),
            ("modalities", any(m != "text" for m in self.modalities or []), 'only ["text"] is served'),
            ("audio", self.audio is not None, "audio output is not supported; leave audio out"),
            ("prediction", self.prediction is not None, "predicted outputs are not supported; leave prediction out"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
        )
        return next((f"{name}: {why}" for name, refused, why in refusals if refused), None)

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (len(v) > 4 or any(not s for s in v)):
            raise ValueError("stop takes at most 4 non-empty strings")
        if v == "":
            raise ValueError("stop must not be empty")
        return v

    @model_validator(mode="after")
    def _has_content(self) -> ChatCompletionRequest:
        if not any(m.text or m.images for m in self.messages):
            raise ValueError("messages must contain at least one message with non-empty content")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The variables the chat template gets besides messages and tools; chat_template_kwargs wins."""
        out: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
            if self.reasoning_effort == "none":
                out["enable_thinking"] = False
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return {**out, **(self.chat_template_kwargs or {})}

    def tool_specs(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's JSON)."""
        return [tool.model_dump(mode="json", exclude_none=True) for tool in self.tools or []]

    def sampling(self) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or 256,
            max_tokens_explicit=(self.max_completion_tokens or self.max_tokens) is not None,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=stops,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            constraint=self.output_constraint(),
            reasoning_budget=self.reasoning_budget,
        )

    def output_constraint(self) -> OutputConstraint | None:
        """A forced tool choice (required, or a named function) constrains the reply to a call; else a JSON
        response_format to JSON (valid against its schema, if it has one)."""
        choice = self.tool_choice
        if self.tools and choice is not None and choice not in ("auto", "none"):
            name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
            tools = [{"name": t.function.name, "parameters": t.function.parameters or {"type": "object"}}
                     for t in self.tools]
            return OutputConstraint(kind="tool_call", tools=tools, tool_name=name if isinstance(name, str) else None)
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = (fmt.json_schema or {}).get("schema") if fmt.type == "json_schema" else None
        return OutputConstraint(kind="json", json_schema=schema)


class OutputConstraint(CamelModel):
    """What decoding is held to (engines/constrained.py): JSON (any object, or valid against json_schema), or one
    call to an offered tool (tool_name: that one; None: any of tools) with arguments valid against its schema."""

    kind: Literal["json", "tool_call"]
    json_schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] = []
    """Offered tools as {"name", "parameters"}: the calls a tool_call constraint may write."""
    tool_name: str | None = None


class SamplingParams(CamelModel):
    """What the engine samples with; bounded like the request, so a command from any source is safe too."""

    max_tokens: MaxTokens = 256
    max_tokens_explicit: bool = False
    """The client asked for max_tokens: a prompt plus that budget beyond the context is refused (400) rather
    than cut short; an implicit budget is clamped to the context left."""
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: list[str] = []
    logprobs: TopLogprobs | None = None
    """None: none reported; n: each token's log-probability and its n most likely alternatives."""
    constraint: OutputConstraint | None = None
    """JSON output or a forced tool call, enforced on every sampled token (None: free text)."""
    reasoning_budget: int | None = Field(default=None, ge=1)
    """The most tokens a thinking reply's reasoning may take, its tags included: the rank that samples forces the
    family's close there and the answer follows (engines/reasoning.py's ReasoningBudget). None: no cap."""
