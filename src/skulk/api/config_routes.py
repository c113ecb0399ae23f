"""GET /config (this node's skulk.yaml and its effective, validated settings) and PUT /config.

A node reads its settings once, at start (config.resolve), and hands them to every part as one frozen object,
so no key can change under a running node today: PUT validates the new file and answers 400 naming the keys
that would need a restart, or 200 when nothing changes. LIVE_KEYS is where a key that can be applied live
would be listed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body
from pydantic import ValidationError

from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.config import ConfigError, Settings, describe_error, yaml_values
from skulk.types.answers import ConfigApplied, ConfigView
from skulk.types.errors import ApiError, ErrorCode

SECRET_KEYS = frozenset({"hf_token", "api_keys", "admin_keys", "cluster_key"})
LIVE_KEYS: frozenset[str] = frozenset()
"""Dotted keys a PUT can apply without a restart (none yet: see the module docstring)."""


def _redacted(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in SECRET_KEYS}


def effective(settings: Settings) -> dict[str, Any]:
    """Every setting in force on this node (defaults, file, environment and flags merged), secrets as flags."""
    dumped = _redacted(settings.model_dump(mode="json"))
    dumped["has_hf_token"] = settings.hf_token is not None
    dumped["has_cluster_key"] = settings.cluster_key is not None
    dumped["api_key_count"], dumped["admin_key_count"] = len(settings.api_keys), len(settings.admin_keys)
    return dumped


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs between two mappings (a key missing on one side counts)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix.rstrip(".") or "config"]
    keys = sorted(set(old) | set(new), key=str)
    return [c for k in keys for c in changed_keys(old.get(k), new.get(k), f"{prefix}{k}.")]


def _current_file(settings: Settings) -> dict[str, Any]:
    try:
        return yaml_values(settings.config)
    except ConfigError as exc:  # edited by hand since the node started: say so rather than 500
        raise ApiError(ErrorCode.config_unreadable, f"{exc}; fix skulk.yaml by hand") from exc


def config_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["config"])

    @router.get("/config", response_model=None, responses=documented(ConfigView, 409))
    async def get_config() -> dict[str, Any]:
        path = node.settings.config
        return {
            "config": _redacted(_current_file(node.settings)),
            "configPath": str(path),
            "fileExists": path.exists(),
            "effective": effective(node.settings),
        }

    @router.put("/config", response_model=None, responses=documented(ConfigApplied, 400, 409, 422))
    async def put_config(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008 - FastAPI's declaration
        """Body: the new skulk.yaml as JSON, bare or under "config" (as Skulk accepts it)."""
        wanted = body["config"] if isinstance(body.get("config"), dict) else body
        current = _current_file(node.settings)
        wanted = {**{k: v for k, v in current.items() if k in SECRET_KEYS}, **wanted}
        try:
            Settings.model_validate(wanted)
        except ValidationError as exc:
            raise ApiError(ErrorCode.invalid_config, describe_error("config", exc).replace("\n", "; ")) from exc
        changed = changed_keys(current, wanted)
        needs_restart = [k for k in changed if k not in LIVE_KEYS]
        if needs_restart:
            raise ApiError(ErrorCode.restart_required,
                           f"these settings take effect only when the node starts: {', '.join(needs_restart)}. "
                           f"skulk.yaml was not changed; edit {node.settings.config} and restart the node")
        return {"message": "no change" if not changed else "applied", "changed": changed,
                "effective": effective(node.settings)}

    return router
