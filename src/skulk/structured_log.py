"""Structured logs (runbook 004, `logging.enabled` in skulk.yaml): one JSON object per line on stdout, beside
the human-readable lines on stderr, for a local shipper (Vector) to forward to `logging.ingest_url`.

Each object has time, level, logger, nodeId and message, plus the ids in context: instanceId, runnerId,
taskId, commandId. Code binds ids with `log_context(...)` around the work they describe (a contextvar, so
concurrent asyncio tasks never see each other's ids); `extra={"task_id": …}` on one call works too.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType

from skulk.config import LoggingConfig
from skulk.redact import ScrubFilter

ID_FIELDS = {"instance_id": "instanceId", "runner_id": "runnerId", "task_id": "taskId", "command_id": "commandId"}
_ids: ContextVar[Mapping[str, str]] = ContextVar("skulk_log_ids", default=MappingProxyType({}))


@contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Bind ids (instance_id, runner_id, task_id, command_id) to every record logged inside the block."""
    token = _ids.set({**_ids.get(), **{k: str(v) for k, v in ids.items() if v}})
    try:
        yield
    finally:
        _ids.reset(token)


class JsonLines(logging.Formatter):
    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "nodeId": self.node_id,
            "message": record.getMessage(),
        }
        bound = _ids.get()
        for key, wire in ID_FIELDS.items():
            value = getattr(record, key, None) or bound.get(key)
            if value:
                body[wire] = str(value)
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


_installed: list[logging.Handler] = []
"""The JSON handler this process added (at most one), so a live change of logging.* replaces it."""


_live: list[LoggingConfig] = []
"""The logging section last installed in this process (at start, then by each PUT /config that changed it)."""


def live_config() -> LoggingConfig | None:
    """The logging section in force in this process now; None before the first install (diagnostics then read
    the settings the node was started with)."""
    return _live[-1] if _live else None


def level_of(name: str) -> int:
    level = logging.getLevelName(name.upper())
    return level if isinstance(level, int) else logging.INFO


def install(config: LoggingConfig, node_id: str) -> logging.Handler | None:
    """Add the stdout JSON handler to the root logger when logging.enabled; the stderr handler stays. Called
    again (PUT /config changed logging.enabled or logging.level), it replaces the one it added."""
    root = logging.getLogger()
    for old in _installed:
        root.removeHandler(old)
    _installed.clear()
    _live[:] = [config]
    if not config.enabled:
        return None
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonLines(node_id))
    handler.addFilter(ScrubFilter())  # no secret in a log line (issue 27)
    handler.setLevel(level_of(config.level))
    root.addHandler(handler)
    _installed.append(handler)
    return handler


def set_level(name: str) -> None:
    """logging.level applied live: the root logger's level (every handler) and the JSON handler's."""
    logging.getLogger().setLevel(level_of(name))
    for handler in _installed:
        handler.setLevel(level_of(name))
