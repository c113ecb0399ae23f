"""TLS on the API (issue 44): a node started with a `skulk tls self-signed` pair serves https that the openai
client reads when it trusts the certificate (models, then a chat on the placed demo model), and nothing over
plain http or to a client that does not trust it (`skulk diag --ca` reads it); two nodes sharing the pair form
one cluster, which needs their topology probes (https, verified against the shared cert) to succeed, and a
cluster diagnostics fan-out over https reads both."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import openai
import pytest

from skulk.diagnostics.cli import main as diag_main
from skulk.tls import write_pair

from .harness import Cluster, place_and_wait

pytestmark = pytest.mark.timeout(240)
DEMO = "skulk/tiny-random-llama"


def test_one_node_serves_https_to_the_openai_client_and_refuses_plain_http(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path / "tls", [])
    cluster = Cluster(tmp_path)
    try:
        (node,) = cluster.start(1, tls=(cert, key))
        assert node.url.startswith("https://")
        trusting = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert)), timeout=60)
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", http_client=trusting)
        assert client.models.list().data == []  # an answer over https (nothing placed yet)
        place_and_wait(node, DEMO)
        assert DEMO in {m.id for m in client.models.list().data}
        chat = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert chat.choices[0].message is not None and chat.usage is not None
        with pytest.raises(httpx.HTTPError):  # plain http to the TLS port: no answer
            httpx.get(f"http://127.0.0.1:{node.api_port}/healthz", timeout=5, trust_env=False)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # a client that trusts no one
            httpx.get(f"{node.url}/healthz", timeout=5, trust_env=False)
        assert any("SKULK_READY" in line and "api=https://" in line for line in node.output)
        diag_main(["--url", node.url, "--ca", str(cert)])  # the CLI verifies against the given CA
        with pytest.raises(SystemExit):
            diag_main(["--url", node.url])  # and without it does not trust the node
    finally:
        cluster.print_logs()
        assert cluster.stop_all() == [], "runner processes outlived their node"


def test_two_nodes_sharing_a_pair_form_a_cluster_over_https(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path / "tls", [])
    cluster = Cluster(tmp_path)
    try:
        nodes = cluster.form(2, tls=(cert, key))  # formed: each probed the other's API over https
        report = nodes[0].get("/v1/diagnostics/cluster", timeout=30)
        assert report is not None
        assert {n["nodeId"] for n in report["nodes"]} == {n.node_id for n in nodes}
        assert all(n["ok"] for n in report["nodes"]), [n.get("error") for n in report["nodes"]]
        assert all(n["url"].startswith("https://") for n in report["nodes"] if n["nodeId"] != nodes[0].node_id)
    finally:
        cluster.print_logs()
        assert cluster.stop_all() == [], "runner processes outlived their node"
