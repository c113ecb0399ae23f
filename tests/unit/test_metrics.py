"""GET /metrics: parsed by prometheus_client's own parser, and behind the admin key on a keyed node."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from skulk.api.app import create_app
from skulk.config import Settings
from skulk.types.state import State
from tests.unit.factories import api_services


def test_metrics_parse_and_read_state() -> None:
    client = TestClient(create_app(api_services(State(term=7), node_id="n1", master="n1")), base_url="http://127.0.0.1")
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples}
    assert samples["skulk_master_term"] == 7 and samples["skulk_is_master"] == 1
    assert samples["skulk_instances"] == 0 and samples["skulk_runners"] == 0


def test_metrics_need_admin_key_on_keyed_node(tmp_path: Path) -> None:
    settings = Settings(config=tmp_path / "skulk.yaml", home=tmp_path, api_keys=["u"], admin_keys=["a"])
    client = TestClient(create_app(api_services(settings=settings, home=tmp_path)), base_url="http://127.0.0.1")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer u"}).status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Bearer a"}).status_code == 200
