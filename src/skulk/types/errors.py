"""Every error code Skulk answers with, its HTTP status, and the one exception that carries one.

The vocabulary lives here, below every layer that raises (master, runner, API, store server), as httpx keeps
its exceptions in one `_exceptions.py`: a code is defined once, with the status a client sees for it. What a
code looks like on each API's wire (OpenAI's `{"error": {...}}`, Claude's, Ollama's) is decided at one boundary,
`skulk.api.errors`; the native (OpenAI) body is `error_body` here because the store server answers it too.

The string values are the codes clients already see: the placement refusals keep their class names
(`InsufficientMemory`), everything else is snake_case."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ErrorCode(StrEnum):
    # 400: the request itself is wrong
    invalid_request = "invalid_request"
    invalid_unicode = "invalid_unicode"
    invalid_path = "invalid_path"
    invalid_task_id = "invalid_task_id"
    invalid_model_id = "invalid_model_id"
    invalid_quantization = "invalid_quantization"
    unsupported_architecture = "unsupported_architecture"
    model_not_chat = "model_not_chat"
    model_not_embedding = "model_not_embedding"
    context_length_exceeded = "context_length_exceeded"
    restart_required = "restart_required"
    host_not_allowed = "host_not_allowed"
    no_config = "no_config"
    no_safetensors = "no_safetensors"
    invalid_model_file = "invalid_model_file"
    invalid_node_id = "invalid_node_id"
    text_only = "text_only"
    """An image, audio or file content part: every model Skulk serves takes text only."""
    unsupported_field = "unsupported_field"
    """A request field Skulk does not honour (Claude's `thinking`, Responses' `background`): refused, not ignored."""
    # 401 / 403: who is asking
    missing_api_key = "missing_api_key"
    invalid_api_key = "invalid_api_key"
    missing_internal_token = "missing_internal_token"
    invalid_internal_token = "invalid_internal_token"
    forbidden = "forbidden"
    internal_route_forbidden = "internal_route_forbidden"
    """A signed node-to-node call to a route nodes never call on each other (placing, deleting, config...)."""
    origin_not_allowed = "origin_not_allowed"
    admin_key_required = "admin_key_required"
    gated_model = "gated_model"
    rate_limited = "rate_limited"
    # 404: nothing by that name
    not_found = "not_found"
    model_not_found = "model_not_found"
    instance_not_found = "instance_not_found"
    node_not_found = "node_not_found"
    runner_not_found = "runner_not_found"
    trace_not_found = "trace_not_found"
    model_not_in_store = "model_not_in_store"
    response_not_found = "response_not_found"
    file_not_in_store = "file_not_in_store"
    event_log_disabled = "event_log_disabled"
    # 405 .. 422: the request meets the state of things
    method_not_allowed = "method_not_allowed"
    request_timeout = "request_timeout"
    conflict = "conflict"
    config_unreadable = "config_unreadable"
    model_exists = "model_exists"
    request_too_large = "request_too_large"
    range_not_satisfiable = "range_not_satisfiable"
    invalid_config = "invalid_config"
    format_version_refused = "format_version_refused"
    """A node-to-node call of a format version this node does not work with (types/versions.py)."""
    # placement refusals (their classes' names, as clients have always seen them)
    InsufficientMemory = "InsufficientMemory"
    NoConnectedCycle = "NoConnectedCycle"
    AllCandidatesExcluded = "AllCandidatesExcluded"
    TensorNotSupported = "TensorNotSupported"
    InstanceKindUnsupported = "InstanceKindUnsupported"
    EngineUnavailable = "EngineUnavailable"
    NotEnoughLayers = "NotEnoughLayers"
    SingleNodeOnly = "SingleNodeOnly"
    InfoPending = "InfoPending"
    KvPoolTooSmall = "KvPoolTooSmall"
    # 5xx: Skulk or the cluster failed the request
    internal_error = "internal_error"
    tool_choice_unmet = "tool_choice_unmet"
    task_failed = "task_failed"
    cancelled = "cancelled"
    hub_unreachable = "hub_unreachable"
    hub_error = "hub_error"
    download_interrupted = "download_interrupted"
    insufficient_disk = "insufficient_disk"
    store_unreachable = "store_unreachable"
    instance_not_ready = "instance_not_ready"
    instance_failed = "instance_failed"
    tokenizer_not_local = "tokenizer_not_local"
    session_changed = "session_changed"
    node_shutting_down = "node_shutting_down"
    placement_timeout = "placement_timeout"
    """The master did not confirm a placement in time (503; before the vocabulary it shared `timeout`)."""
    timeout = "timeout"
    """No token for too long on an open stream (504)."""

    @property
    def status(self) -> int:
        """The HTTP status a client sees for this code."""
        return HTTP_STATUS[self]


VALIDATION_STATUS = 422
"""A body that fails its schema or a bound answers 422 with `invalid_request` (FastAPI's convention, kept), where
the code's own status is 400 (a request Skulk reads and refuses)."""


class ApiError(Exception):
    """The one carrier of a refusal or failure, from the master's command checks to a route: a code, what to do
    about it, and the status (the code's own, unless `status` says otherwise: a validation bound's 422, or the
    status a runner's ErrorChunk already chose)."""

    def __init__(self, code: ErrorCode, message: str, *, status: int | None = None,
                 retryable: bool | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a client's lone surrogate, echoed
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = code.status if status is None else status
        self.retryable = retryable
        """A runner's ErrorChunk says whether the same request may succeed if sent again (its body's
        `retryable`); None for a refusal, which the same request meets again."""

    @property
    def kind(self) -> str:
        return kind_for(self.status)


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable"}


def kind_for(status: int) -> str:
    """OpenAI's error `type` for a status."""
    if status in _KINDS:
        return _KINDS[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def clip_text(text: str, limit: int) -> str:
    """`text` in at most `limit` characters: whole when it fits, else cut at the last word boundary before the
    limit (mid-word only when one word is longer than half of it) and ended with an ellipsis, so a failure
    message never stops in the middle of a word or reads as complete when it is not."""
    if len(text) <= limit:
        return text
    head = text[: max(limit - 1, 0)]
    cut = max(head.rfind(" "), head.rfind("\n"))
    if cut >= limit // 2:
        head = head[:cut]
    return head.rstrip(" ,;:.-(\n") + "…"


def error_body(message: str, *, kind: str, code: str | None = None, **extra: Any) -> dict[str, Any]:
    """Skulk's native error body, OpenAI's shape: {"error": {"message", "type", "code", ...}}."""
    return {"error": {"message": message, "type": kind, "code": code, **extra}}


HTTP_STATUS: dict[ErrorCode, int] = {}
for _status, _codes in {
    400: "invalid_request invalid_unicode invalid_path invalid_task_id invalid_model_id invalid_quantization "
         "unsupported_architecture model_not_chat model_not_embedding context_length_exceeded restart_required "
         "host_not_allowed no_config no_safetensors invalid_model_file invalid_node_id text_only unsupported_field "
         "InsufficientMemory NoConnectedCycle AllCandidatesExcluded TensorNotSupported "
         "InstanceKindUnsupported EngineUnavailable NotEnoughLayers SingleNodeOnly KvPoolTooSmall",
    401: "missing_api_key invalid_api_key missing_internal_token invalid_internal_token gated_model",
    403: "forbidden internal_route_forbidden origin_not_allowed admin_key_required",
    404: "not_found model_not_found instance_not_found node_not_found runner_not_found trace_not_found "
         "model_not_in_store response_not_found file_not_in_store event_log_disabled",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict config_unreadable model_exists format_version_refused",
    413: "request_too_large",
    429: "rate_limited",
    416: "range_not_satisfiable",
    422: "invalid_config tool_choice_unmet",
    500: "internal_error task_failed cancelled",
    502: "hub_unreachable hub_error download_interrupted",
    503: "store_unreachable instance_not_ready instance_failed tokenizer_not_local session_changed node_shutting_down "
         "InfoPending "
         "placement_timeout",
    504: "timeout",
    507: "insufficient_disk",
}.items():
    HTTP_STATUS.update({ErrorCode[name]: _status for name in _codes.split()})


class ErrorDetail(BaseModel):
    """The inside of Skulk's native (OpenAI) error body; extra keys (a placement's details) may ride along."""

    model_config = ConfigDict(extra="allow")
    message: str
    type: str
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """`error_body`'s shape, declared for the OpenAPI document: {"error": {"message", "type", "code"}}."""

    error: ErrorDetail


class ClaudeErrorDetail(BaseModel):
    type: str
    message: str


class ClaudeErrorBody(BaseModel):
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""

    type: Literal["error"]
    error: ClaudeErrorDetail


class OllamaErrorBody(BaseModel):
    """Ollama's error shape: {"error": "..."}."""

    error: str
