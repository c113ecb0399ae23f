"""Typed HTTP errors in OpenAI's shape: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from skulk.types.limits import INVALID_UNICODE

log = logging.getLogger("skulk.api")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, code: str | None = None, kind: str | None = None
    ) -> None:
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a client's lone surrogate, echoed
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind or _kind_for(status)


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable"}


def _kind_for(status: int) -> str:
    if status in _KINDS:
        return _KINDS[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(message: str, *, kind: str, code: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code, **extra}}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, kind=exc.kind, code=exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        if any(err.get("type") == INVALID_UNICODE for err in exc.errors()):  # not a range: the bytes are bad
            body = error_body(_validation_message(exc), kind="invalid_request_error", code="invalid_unicode")
            return JSONResponse(body, status_code=400)
        body = error_body(_validation_message(exc), kind="invalid_request_error", code="invalid_request")
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Every HTTP error in the typed shape, its headers kept (405's Allow, 401's WWW-Authenticate)."""
        body = error_body(str(exc.detail), kind=_kind_for(exc.status_code), code=getattr(exc, "code", None))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(ValidationError)
    async def _invalid_inside(_: Request, exc: ValidationError) -> JSONResponse:
        """A route that builds a model from the request (one API's body translated into another's) and finds it
        invalid: the client's fault, a 422 naming the field, not a 500."""
        parts = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()]
        body = error_body("; ".join(parts) or "invalid request", kind="invalid_request_error", code="invalid_request")
        return JSONResponse(body, status_code=422)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        """A bug answers a typed 500 rather than a plain-text page; the traceback goes to the (rate-limited) log."""
        log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
        return JSONResponse(error_body("internal error; see the node's log", kind="server_error",
                                       code="internal_error"), status_code=500)
