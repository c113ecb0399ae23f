"""PUT /config applies at runtime what can be (log level, JSON logs, tracing) and answers restart_required
only for the keys that need a restart, naming them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from skulk import structured_log
from skulk.api.app import create_app
from skulk.config import Settings
from skulk.types.commands import Command, SetTracingEnabled

from .factories import api_services


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[TestClient, list[Command], Path]]:
    path = tmp_path / "skulk.yaml"
    path.write_text("tracing: {retention_days: 2}\nlogging: {level: INFO}\n")
    sent: list[Command] = []
    settings = Settings(config=path, home=tmp_path)
    root = logging.getLogger()
    level = root.level
    try:
        app = create_app(api_services(settings=settings, commands=sent.append, home=tmp_path))
        with TestClient(app, base_url="http://127.0.0.1") as c:
            yield c, sent, path
    finally:
        structured_log.install(settings.logging, "n1")  # the JSON handler this test added goes
        root.setLevel(level)


def test_live_keys_apply_now_and_are_written(node: tuple[TestClient, list[Command], Path]) -> None:
    client, sent, path = node
    got = client.get("/config").json()
    assert set(got["liveKeys"]) == {"logging.level", "logging.enabled", "tracing.enabled"}
    body = {**got["config"], "logging": {"level": "WARNING", "enabled": True}, "tracing": {"retention_days": 2,
                                                                                        "enabled": True}}
    reply = client.put("/config", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["applied"] == ["logging.enabled", "logging.level", "tracing.enabled"]
    assert answer["restartRequired"] == []
    assert logging.getLogger().level == logging.WARNING
    assert any(isinstance(h.formatter, structured_log.JsonLines) for h in logging.getLogger().handlers)
    assert [c.enabled for c in sent if isinstance(c, SetTracingEnabled)] == [True]
    assert yaml.safe_load(path.read_text())["logging"] == {"level": "WARNING", "enabled": True}
    effective = client.get("/config").json()["effective"]
    assert effective["logging"]["level"] == "WARNING" and effective["tracing"]["enabled"] is True
    assert _configured(client) is True, "diagnostics read the live state, not the start's settings"
    off = client.put("/config", json={**body, "logging": {"level": "WARNING", "enabled": False}})
    assert off.json()["applied"] == ["logging.enabled"]
    assert not any(isinstance(h.formatter, structured_log.JsonLines) for h in logging.getLogger().handlers)
    assert _configured(client) is False


def _configured(client: TestClient) -> bool:
    return client.get("/v1/diagnostics/node").json()["runtime"]["structuredLoggingConfigured"]


def test_restart_required_names_only_the_keys_that_need_it(node: tuple[TestClient, list[Command], Path]) -> None:
    client, sent, path = node
    before = path.read_text()
    reply = client.put("/config", json={"tracing": {"retention_days": 5, "enabled": True},
                                        "logging": {"level": "INFO"}, "api_port": 6000})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert reply.json()["error"]["code"] == "restart_required"
    assert "api_port, tracing.retention_days (tracing.enabled would apply live)" in message
    assert path.read_text() == before and sent == [], "nothing changed"


def test_a_section_the_file_lacks_is_compared_key_by_key() -> None:
    from skulk.api.config_routes import changed_keys

    assert changed_keys({}, {"logging": {"level": "INFO", "enabled": True}}) == ["logging.enabled", "logging.level"]
    assert changed_keys({"tracing": {"enabled": True}}, {}) == ["tracing.enabled"]
