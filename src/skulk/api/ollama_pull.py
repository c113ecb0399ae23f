"""Ollama's POST /api/pull: the way Ollama users fetch a model, through Skulk's documented download path.

`{"model": "org/name"}` names a Hugging Face checkpoint (Skulk's model ids; an Ollama library tag such as
`llama3:8b` is refused with a 400 that says so, and `skulk models import ollama:<tag>` reads a local Ollama
store instead). The model is carded like `POST /models/add` and its files are downloaded into the model store like
`POST /store/models/{id}/download` (by the store host when one is configured). The answer is Ollama's progress
stream, one JSON object a line:

    {"status": "pulling manifest"}
    {"status": "downloading org/name", "digest": "sha256:…", "total": N, "completed": M}   (as bytes arrive)
    {"status": "verifying sha256 digest"} {"status": "writing manifest"} {"status": "success"}

or `{"error": "..."}` as the last line. With `"stream": false` only the last object is sent (an error with its
HTTP status)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from skulk.api.model_facts import digest
from skulk.api.models import known_card
from skulk.api.services import ApiServices
from skulk.api.store import at_store_host
from skulk.store.files import is_complete
from skulk.store.hub import HubError, preflight
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import ModelId
from skulk.types.limits import ModelText

POLL_S = 0.2
"""How often the download's progress is read for a new `downloading` line."""


class OllamaPullRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    model: ModelText | None = None
    name: ModelText | None = None
    """Older clients' spelling of `model`."""
    stream: bool = True
    insecure: bool = False


def pull_model_id(body: OllamaPullRequest) -> str:
    name = body.model or body.name
    if not name:
        raise ApiError(ErrorCode.invalid_request, "model is required: a Hugging Face id, org/name")
    if "/" not in name or ":" in name:
        raise ApiError(ErrorCode.invalid_model_id,
                       f"{name!r} is not a Hugging Face model id: Skulk pulls org/name checkpoints from Hugging Face "
                       "(an Ollama library tag is imported from a local Ollama store with "
                       f"`skulk models import ollama:{name}`)")
    return name


async def _start(node: ApiServices, model_id: str) -> None:
    """The download started where the store lives; ApiError when the hub refuses the model first."""
    forwarded = await at_store_host(node, "POST", f"/store/models/{model_id}/download")
    if forwarded is not None:
        if forwarded.status_code >= 400:
            raise ApiError(ErrorCode.hub_error, _message(forwarded), status=forwarded.status_code)
        return
    files = node.files
    if is_complete(files.store_dir(model_id)):
        return
    try:
        await asyncio.to_thread(preflight, files.hub, model_id, files.store_dir(model_id))
    except HubError as exc:
        raise ApiError(exc.code, exc.message, status=exc.status) from exc
    progress = files.progress.get(ModelId(model_id))
    if progress is None or progress.status in ("Failed", "Completed"):
        node.files.progress.pop(ModelId(model_id), None)  # a new attempt: no stale Completed or Failed
        _keep(asyncio.get_running_loop().create_task(files.download(model_id)))


async def _progress(node: ApiServices, model_id: str) -> dict[str, Any]:
    """The download's state as /store/models/{id}/download/status answers it (camelCase fields)."""
    forwarded = await at_store_host(node, "GET", f"/store/models/{model_id}/download/status")
    if forwarded is not None:
        if forwarded.status_code >= 400:  # the store host lost the download: say so, never poll forever
            return {"status": "Failed", "error": _message(forwarded), "errorStatus": forwarded.status_code}
        return json.loads(bytes(forwarded.body))
    progress = node.files.progress.get(ModelId(model_id))
    if progress is None:
        done = is_complete(node.files.store_dir(model_id))
        return {"status": "Completed" if done else "Pending"}
    return progress.model_dump(mode="json", by_alias=True)


def _message(response: JSONResponse) -> str:
    try:
        body = json.loads(bytes(response.body))
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"the store host answered HTTP {response.status_code}"


async def pull_lines(node: ApiServices, model_id: str) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress objects for one pull; the last is `success` or `error`."""
    yield {"status": "pulling manifest"}
    try:
        card = await known_card(node, model_id)
        if card.builtin:  # generated where it is placed: nothing to download
            yield {"status": "success"}
            return
        await _start(node, model_id)
    except ApiError as exc:
        yield {"error": exc.message, "_status": exc.status}
        return
    name, last = digest(card), None
    while True:
        progress = await _progress(node, model_id)
        status = progress.get("status")
        if status == "Failed":
            yield {"error": str(progress.get("error") or "the download failed"),
                   "_status": int(progress.get("errorStatus") or 502)}
            return
        seen = (progress.get("totalBytes"), progress.get("downloadedBytes"))
        if seen != last and seen[0]:
            last = seen
            yield {"status": f"downloading {model_id}", "digest": name, "total": seen[0], "completed": seen[1]}
        if status == "Completed":
            break
        await asyncio.sleep(POLL_S)
    for step in ("verifying sha256 digest", "writing manifest", "success"):
        yield {"status": step}


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for line in lines:
        line.pop("_status", None)
        yield json.dumps(line, separators=(",", ":")) + "\n"


async def pull(node: ApiServices, body: OllamaPullRequest) -> Response:
    model_id = pull_model_id(body)
    if body.stream:
        return StreamingResponse(_ndjson(pull_lines(node, model_id)), media_type="application/x-ndjson")
    lines = [line async for line in pull_lines(node, model_id)]
    last = lines[-1]
    status = int(last.pop("_status", 200))
    return JSONResponse(last, status_code=status)


_background: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _background.add(task)
    task.add_done_callback(_background.discard)
