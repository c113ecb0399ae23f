"""The catalog: GET /models in Skulk's list shape, POST /models/add from a Hugging Face checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter
from huggingface_hub import hf_hub_url
from huggingface_hub.utils import build_hf_headers
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.api.store import valid_model_id
from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import MAX_CONFIG, parse_config, read_config
from skulk.models.cards import add_custom_card, all_cards, get_card, is_custom
from skulk.models.catalog import UnsupportedArchitecture, card_from_config, list_entry, weight_bytes
from skulk.models.memory_math import checkpoint_tensor_bytes
from skulk.state.queries import served_context
from skulk.store.files import INDEX_FILE, MODEL_ID_PATTERN, is_complete, local_files, model_dir_name
from skulk.store.hub import Hub, HubError, list_files
from skulk.store.service import ModelFiles
from skulk.types.answers import Catalog, CatalogEntry
from skulk.types.commands import AddModelCard
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, new_id
from skulk.types.models import ModelCard


class AddModelRequest(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    model_id: str = Field(min_length=3, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ImportModelRequest(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    source: str = Field(min_length=1, max_length=4096)
    """An absolute path to a .gguf file on this node, or ollama:<name>[:tag] from its local Ollama store."""
    model_id: str | None = Field(default=None, min_length=3, pattern=MODEL_ID_PATTERN)
    ollama_models: str | None = Field(default=None, min_length=1, max_length=4096)
    """For an `ollama:` source: the Ollama store to look in on this node (`skulk models import` sends its own
    OLLAMA_MODELS); else the node's $OLLAMA_MODELS, else ~/.ollama/models."""


def models_router(node: ApiServices) -> APIRouter:
    files = node.files
    router = APIRouter(tags=["models"])

    @router.get("/models", response_model=None, responses=documented(Catalog))
    async def get_models() -> dict[str, Any]:
        state = node.state
        return {"data": [list_entry(card, created=0, where=_where(files, card),
                                    context_length=served_context(state, card)) for card in all_cards()]}

    @router.post("/models/add", response_model=None, responses=documented(CatalogEntry, 400, 401, 404, 502))
    async def add_model(body: AddModelRequest) -> dict[str, Any]:
        known = await known_card(node, body.model_id)
        return list_entry(known, created=0, where=_where(files, known))

    @router.post("/models/import", response_model=None, responses=documented(CatalogEntry, 400, 409))
    async def import_model(body: ImportModelRequest) -> dict[str, Any]:
        """A GGUF file (or an Ollama model) into this node's store and the catalog; the store stages it to
        other nodes like any model. 400 for a source that is not a GGUF file the engine runs. The import runs
        in a child process under a memory and time budget (models/import_worker.py): a hostile file costs one
        400 and never this node's event loop."""
        from skulk.models.import_worker import import_in_child

        if body.model_id is not None and get_card(body.model_id) is not None and not is_custom(body.model_id):
            raise ApiError(ErrorCode.model_exists,
                           f"{body.model_id} is a catalog model; import under another id")
        card = await import_in_child(body.source, node.settings.store_path, body.model_id,
                                     ollama_models=body.ollama_models)
        add_custom_card(node.settings.home / "cards", card)
        node.send_command(AddModelCard(command_id=CommandId(new_id()), card=card))
        return list_entry(card, created=0, where=_where(files, card))

    return router


async def known_card(node: ApiServices, model_id: str) -> ModelCard:
    """The catalog's card for a model, or one built from its config (this node's store copy, else the hub) and
    added to the catalog of every node. ApiError for a hub that refuses or a model the engine cannot run."""
    known = get_card(valid_model_id(model_id))
    if known is not None:
        return known
    files = node.files
    hub = Hub(node.settings.model_store.download.hf_endpoint, node.settings.hf_token)
    try:
        known = await asyncio.to_thread(build_card, hub, model_id, files.store_dir(model_id))
    except HubError as exc:
        raise ApiError(exc.code, exc.message, status=exc.status) from exc
    except UnsupportedArchitecture as exc:
        raise ApiError(ErrorCode.unsupported_architecture, str(exc)) from exc
    except InvalidModelFile as exc:
        raise ApiError(ErrorCode.invalid_model_file, f"{model_id}: {exc}") from exc
    except Exception as exc:
        raise ApiError(ErrorCode.hub_unreachable, f"the model hub could not be reached for {model_id}: {exc}") from exc
    add_custom_card(node.settings.home / "cards", known)
    node.send_command(AddModelCard(command_id=CommandId(new_id()), card=known))
    return known


def build_card(hub: Hub, model_id: str, local: Path | None) -> ModelCard:
    """From this node's store copy when it has one, else from the hub (config.json and the index only)."""
    if local is not None and is_complete(local):
        config = read_config(local / "config.json")
        index_path = local / INDEX_FILE
        index = read_config(index_path) if index_path.exists() else None
        tensors = checkpoint_tensor_bytes(local)  # the real per-layer bytes (bounded header reads)
        return card_from_config(model_id, config, weight_bytes(local_files(local), index), tensors)
    repo = list_files(hub, model_id)
    if "config.json" not in repo.files:
        raise HubError(ErrorCode.no_config, f"model {model_id} has no config.json")
    config = _fetch_json(hub, model_id, repo.commit, "config.json")
    index = _fetch_json(hub, model_id, repo.commit, INDEX_FILE) if INDEX_FILE in repo.files else None
    return card_from_config(model_id, config, weight_bytes(repo.files, index))


def _fetch_json(hub: Hub, model_id: str, commit: str, name: str) -> dict[str, Any]:
    """A small JSON file of the repo, read no further than MAX_CONFIG bytes and checked (formats/checkpoint.py)."""
    url = hf_hub_url(model_id, name, revision=commit, endpoint=hub.endpoint)
    headers = build_hf_headers(token=hub.token or False)
    with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=30) as response:
        if response.status_code in (401, 403):
            raise HubError(ErrorCode.gated_model,
                           f"model {model_id} is gated; set hf_token in skulk.yaml (or HF_TOKEN)")
        if response.status_code != 200:
            raise HubError(ErrorCode.hub_error, f"fetching {name} of {model_id}: HTTP {response.status_code}")
        raw = bytearray()
        for chunk in response.iter_bytes():
            raw += chunk
            if len(raw) > MAX_CONFIG:
                break
    return parse_config(bytes(raw), name)


def _where(files: ModelFiles | None, card: ModelCard) -> dict[str, Any]:
    """This node's copies: downloaded into its store, staged, and the latest progress."""
    if files is None or card.builtin:
        return {"downloaded": card.builtin, "staged": False}
    progress = files.progress.get(card.model_id)
    staged = files.staging_root / model_dir_name(card.model_id)
    return {
        "downloaded": is_complete(files.store_dir(card.model_id)),
        "staged": staged.is_dir() and is_complete(staged),
        "download": progress.model_dump(mode="json") if progress else None,
    }
