"""The store host's file server: the authoritative copies under store_path, over HTTP on the LAN.

Only complete models are listed or served; Range requests let a stager resume. Nothing outside store_path is
reachable: a model id must be `org/name` without dot segments, a file name a plain name of the model's
directory; anything else is 400, a missing model or file 404.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse

from skulk.api.errors import ApiError, install_error_handlers
from skulk.models.cards import model_dir_name
from skulk.store.files import is_complete, local_files, read_marker


class _BigChunkFileResponse(FileResponse):
    """Starlette reads a file in 64 KiB pieces, each a thread hop; 4 MiB pieces let the store saturate a LAN."""

    chunk_size = 4 * 1024 * 1024


_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def safe_part(part: str, what: str) -> str:
    """One path component that cannot climb out of its directory."""
    if not _PART.fullmatch(part) or ".." in part:
        raise ApiError(400, f"invalid {what} {part!r}", code="invalid_path")
    return part


def model_path(store_path: Path, model_id: str) -> Path:
    org, _, name = model_id.partition("/")
    if not name:
        raise ApiError(400, f"invalid model id {model_id!r}; expected org/name", code="invalid_path")
    path = store_path / model_dir_name(f"{safe_part(org, 'model id')}/{safe_part(name, 'model id')}")
    if store_path.resolve() not in path.resolve().parents:
        raise ApiError(400, f"invalid model id {model_id!r}", code="invalid_path")
    return path


def registry(store_path: Path) -> list[dict[str, Any]]:
    """The complete models of the store, as /store/registry lists them."""
    entries = []
    if store_path.is_dir():
        for path in sorted(p for p in store_path.iterdir() if p.is_dir() and is_complete(p)):
            marker = read_marker(path)
            files = local_files(path)
            entries.append(
                {
                    "model_id": marker.model_id if marker else path.name.replace("--", "/", 1),
                    "total_bytes": sum(files.values()),
                    "downloaded_at": marker.downloaded_at.isoformat() if marker else None,
                }
            )
    return entries


def create_store_app(store_path: Path) -> FastAPI:
    app = FastAPI(title="Skulk model store")
    install_error_handlers(app)

    @app.get("/registry")
    async def get_registry() -> dict[str, Any]:
        return {"entries": registry(store_path)}

    @app.get("/models/{org}/{name}/files")
    async def files(org: str, name: str) -> dict[str, Any]:
        path = model_path(store_path, f"{org}/{name}")
        if not path.is_dir() or not is_complete(path):
            raise ApiError(404, f"the store has no complete copy of {org}/{name}", code="model_not_in_store")
        return {"model_id": f"{org}/{name}", "files": local_files(path)}

    @app.get("/models/{org}/{name}/files/{filename}")
    async def file(org: str, name: str, filename: str) -> FileResponse:
        path = model_path(store_path, f"{org}/{name}") / safe_part(filename, "file name")
        if not path.is_file() or not is_complete(path.parent):
            raise ApiError(404, f"the store has no file {filename} of {org}/{name}", code="file_not_in_store")
        return _BigChunkFileResponse(path, media_type="application/octet-stream")

    return app
