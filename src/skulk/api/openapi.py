"""What each route answers, for `/openapi.json`: its success body and the error statuses with their error shape.

Declared through the decorators' `responses=` (documentation only), never `response_model=`, which would filter
and re-serialize the bytes a client gets. Statuses every route can answer (the security middleware's 401/403,
the body limit's 408/413, a bug's 500) are added to every route once, by `declare_common_errors`; a route
declares the statuses its own logic answers, in its API family's error shape (`skulk.api.errors`)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute

from skulk.types.errors import ClaudeErrorBody, OllamaErrorBody, OpenAIErrorBody

COMMON_ERRORS = (401, 403, 408, 413, 500)
"""Answered before or around any route, always in Skulk's native (OpenAI) shape."""


class Family(StrEnum):
    openai = "openai"
    claude = "claude"
    ollama = "ollama"


ERROR_MODELS: dict[Family, type] = {Family.openai: OpenAIErrorBody, Family.claude: ClaudeErrorBody,
                                    Family.ollama: OllamaErrorBody}

STREAM_TYPES = {"sse": "text/event-stream", "ndjson": "application/x-ndjson"}


def documented(ok: Any, *errors: int, family: Family = Family.openai, stream: str | None = None,
              status: int = 200, content_type: str = "application/json") -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: `ok` (a model, or None for a body that is not JSON) at `status`, optionally
    also streamed (`stream="sse"` or `"ndjson"`), and each error status in `family`'s error shape."""
    success: dict[str, Any] = {"description": "Success"}
    if ok is not None:
        success["model"] = ok
    if stream is not None:
        success["content"] = {STREAM_TYPES[stream]: {"schema": {"type": "string"}}}
    if ok is None and stream is None:
        success["content"] = {content_type: {"schema": {"type": "string"}}}
    declared: dict[int | str, dict[str, Any]] = {status: success}
    for code in errors:
        declared[code] = {"model": ERROR_MODELS[family], "description": "Error"}
    return declared


def declare_common_errors(router: APIRouter) -> APIRouter:
    """Every route lists the statuses the middleware and the error boundary answer for it, in the native shape;
    a route that reads parameters or a body lists the validation 422 in the native shape too (FastAPI's own
    `HTTPValidationError` is never sent). Called before `include_router`, which builds the routes anew from
    these declarations."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            continue
        for code in COMMON_ERRORS:
            route.responses.setdefault(code, {"model": OpenAIErrorBody, "description": "Error"})
        if route.body_field is not None or route.dependant.path_params or route.dependant.query_params:
            route.responses.setdefault(422, {"model": OpenAIErrorBody, "description": "Invalid request"})
    return router
