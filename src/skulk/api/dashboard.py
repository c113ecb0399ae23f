"""The web dashboard: `/` serves index.html, `/assets/<version>/…` the ES modules it loads, and every unknown
non-API GET that asks for HTML falls back to index.html so the dashboard's own routes (/chat, /operator, …)
survive a reload.

The assets are plain ES modules shipped inside the package (skulk/dashboard/static): no build step, nothing
loaded from the internet. `<version>` is a hash of every shipped file, so assets are cached for a year and a new
release is fetched at once; index.html itself is revalidated on every load.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from skulk.dashboard import STATIC_DIR
from skulk.types.errors import ApiError, ErrorCode

ASSETS_PREFIX = "/assets"
PAGE_PATHS = ("/cluster", "/catalog", "/placing", "/chat", "/operator", "/settings")
"""The dashboard's own routes besides `/` (js/main.js PAGES): static pages, no cluster data in them."""
INDEX_PLACEHOLDER = "%ASSETS%"
IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "no-cache"
MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".html": "text/html; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".json": "application/json",
}
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
"""Only this node: the dashboard loads nothing from elsewhere, and an injected script could not either."""


def shipped_files(root: Path = STATIC_DIR) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "index.html")


@cache
def assets_version(root: Path = STATIC_DIR) -> str:
    """A hash of every shipped file: it names the asset URLs, so a changed file is a new URL."""
    digest = hashlib.sha256()
    for path in [*shipped_files(root), root / "index.html"]:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@cache
def index_html(root: Path = STATIC_DIR) -> str:
    return (root / "index.html").read_text().replace(INDEX_PLACEHOLDER, f"{ASSETS_PREFIX}/{assets_version(root)}")


def asset_path(relative: str, root: Path = STATIC_DIR) -> Path | None:
    """The shipped file at `relative`, or None: nothing outside the static folder, no dot-files."""
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return None
    path = (root / relative).resolve()
    if not path.is_file() or not path.is_relative_to(root.resolve()) or path.name == "index.html":
        return None
    return path


def index_response() -> HTMLResponse:
    return HTMLResponse(index_html(), headers={"Cache-Control": REVALIDATE, "Content-Security-Policy": CSP})


def dashboard_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"], include_in_schema=False)

    @router.get("/")
    async def index() -> HTMLResponse:
        return index_response()

    @router.get(ASSETS_PREFIX + "/{version}/{relative:path}")
    async def asset(version: str, relative: str) -> Response:
        path = asset_path(relative)
        if path is None or version != assets_version():
            raise ApiError(ErrorCode.not_found, f"no dashboard asset {relative} in this release; reload the page")
        media = MEDIA_TYPES.get(path.suffix, "application/octet-stream")
        return FileResponse(path, media_type=media, headers={"Cache-Control": IMMUTABLE})

    return router


def is_dashboard_path(path: str) -> bool:
    """Paths that serve the dashboard itself: static files only, so no API key is needed to load the page that
    asks for one (every API call it then makes needs the key as usual)."""
    page = path.rstrip("/")
    return path == "/" or path.startswith(ASSETS_PREFIX + "/") or page in PAGE_PATHS


def api_segments(app: FastAPI) -> set[str]:
    """The first path segment of every API path (from the OpenAPI document, which sees through included
    routers): an unknown path under one of them is an API 404, not a page."""
    paths = [getattr(route, "path", "") for route in app.router.routes]
    try:
        paths += list(app.openapi().get("paths", {}))
    except Exception:  # a schema that cannot be built must not take the pages down; known routes still count
        pass
    segments = {p.strip("/").split("/")[0] for p in paths if p and not is_dashboard_path(p)}
    return {s for s in segments if s and not s.startswith("{")}


class SpaFallback:
    """A GET for HTML that no route serves, outside the API's paths, gets index.html: the dashboard's own
    routes survive a reload or a shared link. Everything else passes through untouched."""

    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi
        self._api: set[str] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._wants_page(scope):
            await index_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _wants_page(self, scope: Scope) -> bool:
        if scope["method"] not in ("GET", "HEAD"):
            return False
        accept = dict(scope["headers"]).get(b"accept", b"")
        if b"text/html" not in accept:
            return False
        path: str = scope["path"]
        if self._api is None:
            self._api = api_segments(self.fastapi)
        if path.strip("/").split("/")[0] in self._api or path.startswith(ASSETS_PREFIX + "/"):
            return False
        return not any(route.matches(scope)[0] != Match.NONE for route in self.fastapi.router.routes)


def install_dashboard(app: FastAPI) -> None:
    app.include_router(dashboard_router())
    app.add_middleware(SpaFallback, fastapi=app)
