"""The one boundary where an ApiError (skulk.types.errors) becomes bytes: OpenAI's shape (Skulk's own) for every
route, Claude's and Ollama's for theirs. The codes and their statuses live in skulk.types.errors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from skulk.types.errors import VALIDATION_STATUS, ApiError, ErrorCode, error_body, kind_for
from skulk.types.limits import INVALID_UNICODE, TEXT_ONLY

__all__ = ["ApiError", "ErrorCode", "claude_error", "claude_error_body", "error_body", "install_error_handlers",
           "ollama_error", "openai_error", "text_only_error"]

log = logging.getLogger("skulk.api")


def openai_error(exc: ApiError) -> JSONResponse:
    """OpenAI's shape (Skulk's own): {"error": {"message", "type", "code"}}."""
    extra = {} if exc.retryable is None else {"retryable": exc.retryable}
    return JSONResponse(error_body(exc.message, kind=exc.kind, code=exc.code, **extra), status_code=exc.status)


_CLAUDE_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                 429: "rate_limit_error", 503: "overloaded_error"}


def claude_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's shape: {"type": "error", "error": {"type", "message"}} (no code: Anthropic has none)."""
    return {"type": "error", "error": {"type": _CLAUDE_TYPES.get(status, "api_error"), "message": message}}


def claude_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(claude_error_body(exc.status, exc.message), status_code=exc.status)


def ollama_error(exc: ApiError) -> JSONResponse:
    """Ollama's shape: {"error": "..."} with the HTTP status."""
    return JSONResponse({"error": exc.message}, status_code=exc.status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def text_only_error(errors: Sequence[Any]) -> ApiError | None:
    """One 400 for a content part a text model cannot read (an image, audio, a file), with its place in the body,
    where pydantic would list every other shape the part failed to be."""
    for err in errors:
        if err.get("type") == TEXT_ONLY:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and "[" not in str(p))  # no unions
            return ApiError(ErrorCode.text_only, f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return openai_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        if (text_only := text_only_error(exc.errors())) is not None:
            return openai_error(text_only)
        if any(err.get("type") == INVALID_UNICODE for err in exc.errors()):  # not a range: the bytes are bad
            return openai_error(ApiError(ErrorCode.invalid_unicode, _validation_message(exc)))
        return openai_error(ApiError(ErrorCode.invalid_request, _validation_message(exc), status=VALIDATION_STATUS))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Every HTTP error in the typed shape, its headers kept (405's Allow, 401's WWW-Authenticate)."""
        body = error_body(str(exc.detail), kind=kind_for(exc.status_code), code=getattr(exc, "code", None))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(ValidationError)
    async def _invalid_inside(_: Request, exc: ValidationError) -> JSONResponse:
        """A route that builds a model from the request (one API's body translated into another's) and finds it
        invalid: the client's fault, a 422 naming the field, not a 500."""
        if (text_only := text_only_error(exc.errors())) is not None:
            return openai_error(text_only)
        parts = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()]
        return openai_error(ApiError(ErrorCode.invalid_request, "; ".join(parts) or "invalid request",
                                     status=VALIDATION_STATUS))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        """A bug answers a typed 500 rather than a plain-text page; the traceback goes to the (rate-limited) log."""
        log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
        return openai_error(ApiError(ErrorCode.internal_error, "internal error; see the node's log"))
