"""GET /config (this node's skulk.yaml and its effective, validated settings) and PUT /config.

A node reads its settings once, at start (config.resolve), and hands them to every part as one frozen object;
only the keys in LIVE_KEYS change under a running node: the log level, the JSON log lines (logging.enabled)
and runtime tracing (tracing.enabled, a cluster-wide command). PUT validates the new file; when it changes
only live keys it applies them, writes skulk.yaml and answers 200 with what it applied; when it changes any
other key it changes nothing and answers 400 restart_required naming exactly those keys (and the live ones it
would have applied), so the operator edits the file and restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from fastapi import APIRouter, Body
from pydantic import ValidationError

from skulk import structured_log
from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.config import ConfigError, Settings, describe_error, yaml_values
from skulk.types.answers import ConfigApplied, ConfigView
from skulk.types.commands import SetTracingEnabled
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, new_id

SECRET_KEYS = frozenset({"hf_token", "api_keys", "admin_keys", "cluster_key"})
LIVE_KEYS: frozenset[str] = frozenset({"logging.level", "logging.enabled", "tracing.enabled"})
"""Dotted keys a PUT applies without a restart (the dashboard's Settings page marks the others)."""


def _redacted(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in SECRET_KEYS}


def effective(settings: Settings, live: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every setting in force on this node (defaults, file, environment and flags merged, then what PUT
    applied live), secrets as flags."""
    if live:
        settings = settings.model_copy(update={
            "logging": settings.logging.model_copy(update=live.get("logging", {})),
            "tracing": settings.tracing.model_copy(update=live.get("tracing", {})),
        })
    dumped = _redacted(settings.model_dump(mode="json"))
    dumped["has_hf_token"] = settings.hf_token is not None
    dumped["has_cluster_key"] = settings.cluster_key is not None
    dumped["api_key_count"], dumped["admin_key_count"] = len(settings.api_keys), len(settings.admin_keys)
    return dumped


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs between two mappings (a key missing on one side counts; a section
    missing on one side counts as empty, so its keys are named one by one)."""
    if isinstance(old, dict) and new is None:
        new = {}
    if isinstance(new, dict) and old is None:
        old = {}
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix.rstrip(".") or "config"]
    keys = sorted(set(old) | set(new), key=str)
    return [c for k in keys for c in changed_keys(old.get(k), new.get(k), f"{prefix}{k}.")]


def _current_file(settings: Settings) -> dict[str, Any]:
    try:
        return yaml_values(settings.config)
    except ConfigError as exc:  # edited by hand since the node started: say so rather than 500
        raise ApiError(ErrorCode.config_unreadable, f"{exc}; fix skulk.yaml by hand") from exc


def _write(path: Path, values: dict[str, Any]) -> None:
    """The new skulk.yaml, atomically (comments in the old file are not kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(values, sort_keys=False))
    tmp.replace(path)


def _apply_live(node: ApiServices, new: Settings, keys: list[str]) -> None:
    """Each live key in force now: logging through structured_log, tracing as the cluster-wide command."""
    if "logging.enabled" in keys or "logging.level" in keys:
        structured_log.install(new.logging, node.node_id)
        structured_log.set_level(new.logging.level)
    if "tracing.enabled" in keys:
        node.send_command(SetTracingEnabled(command_id=CommandId(new_id()), enabled=new.tracing.enabled))


def config_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["config"])
    live: dict[str, Any] = {}
    """What PUT applied since start, by section: GET's effective shows it."""

    @router.get("/config", response_model=None, responses=documented(ConfigView, 409))
    async def get_config() -> dict[str, Any]:
        path = node.settings.config
        return {
            "config": _redacted(_current_file(node.settings)),
            "configPath": str(path),
            "fileExists": path.exists(),
            "effective": effective(node.settings, live),
            "liveKeys": sorted(LIVE_KEYS),
        }

    @router.put("/config", response_model=None, responses=documented(ConfigApplied, 400, 409, 422))
    async def put_config(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008 - FastAPI's declaration
        """Body: the new skulk.yaml as JSON, bare or under "config" (as Skulk accepts it)."""
        wanted = body["config"] if isinstance(body.get("config"), dict) else body
        current = _current_file(node.settings)
        wanted = {**{k: v for k, v in current.items() if k in SECRET_KEYS}, **wanted}
        try:
            new = Settings.model_validate(wanted)
        except ValidationError as exc:
            raise ApiError(ErrorCode.invalid_config, describe_error("config", exc).replace("\n", "; ")) from exc
        changed = changed_keys(current, wanted)
        needs_restart = [k for k in changed if k not in LIVE_KEYS]
        applied = [k for k in changed if k in LIVE_KEYS]
        if needs_restart:
            also = f" ({', '.join(applied)} would apply live)" if applied else ""
            raise ApiError(ErrorCode.restart_required,
                           f"these settings take effect only when the node starts: {', '.join(needs_restart)}"
                           f"{also}. skulk.yaml was not changed; edit {node.settings.config} and restart the "
                           "node, or send only the live keys")
        if applied:
            _write(node.settings.config, wanted)
            _apply_live(node, new, applied)
            for key in applied:
                section, name = key.split(".", 1)
                live.setdefault(section, {})[name] = getattr(getattr(new, section), name)
        return {"message": "no change" if not changed else "applied", "changed": changed, "applied": applied,
                "restartRequired": [], "effective": effective(node.settings, live)}

    return router
