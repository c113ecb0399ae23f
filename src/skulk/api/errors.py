"""Typed HTTP errors in OpenAI's shape: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, code: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind or _kind_for(status)


def _kind_for(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status in (400, 422):
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    return "server_error"


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
        body = error_body(_validation_message(exc), kind="invalid_request_error", code="invalid_request")
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), kind=_kind_for(exc.status_code)), exc.status_code)
