"""The day-two settings reach Settings through config.py: skulk.yaml sections and their environment twins."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from skulk.config import ConfigError, resolve
from skulk.diagnostics.health import cluster_health, event_log_reason
from skulk.types.ids import NodeId
from skulk.types.state import State


def test_env_twins_of_logging_tracing_event_log_and_namespace(tmp_path: Path) -> None:
    env = {
        "SKULK_HOME": str(tmp_path),
        "SKULK_LOGGING_ENABLED": "1",
        "SKULK_LOGGING_INGEST_URL": "http://vector:9000",
        "SKULK_TRACING_ENABLED": "true",
        "SKULK_TRACING_RETENTION_DAYS": "0",
        "SKULK_EVENT_LOG_MAX_BYTES": "4096",
        "SKULK_EVENT_LOG_FREE_FLOOR_BYTES": "0",
        "SKULK_LIBP2P_NAMESPACE": "ns1",
    }
    settings = resolve({}, env)
    assert settings.logging.enabled and settings.logging.ingest_url == "http://vector:9000"
    assert settings.tracing.enabled and settings.tracing.retention_days == 0
    assert settings.event_log.max_bytes == 4096 and settings.event_log.free_space_floor_bytes == 0
    assert settings.event_log.keep_events == 20_000 and settings.event_log.check_every == 1024
    assert settings.libp2p_namespace == "ns1"
    assert resolve({}, {"SKULK_HOME": str(tmp_path)}).libp2p_namespace is None


def test_event_log_section_in_yaml_is_validated(tmp_path: Path) -> None:
    config = tmp_path / "skulk.yaml"
    config.write_text("event_log: {keep_events: 10, max_bytes: 100000}\n")
    settings = resolve({"config": str(config), "home": str(tmp_path)}, {})
    assert (settings.event_log.keep_events, settings.event_log.max_bytes) == (10, 100000)
    config.write_text("event_log: {keep_event: 10}\n")
    with pytest.raises(ConfigError, match="keep_event"):
        resolve({"config": str(config), "home": str(tmp_path)}, {})


def test_counting_only_is_a_degraded_reason_of_the_answering_node() -> None:
    node, peer, now = NodeId("n1"), NodeId("n2"), datetime.now(UTC)
    state = State(last_seen={node: now, peer: now})
    health = cluster_health(state, now, {node: [event_log_reason("0.50 GiB free, below the 2.00 GiB floor")]})
    assert health[node].level == "degraded"
    assert [r.code for r in health[node].reasons] == ["event_log_counting_only"]
    assert "purge" not in health[node].reasons[0].remediation and health[peer].level == "healthy"
