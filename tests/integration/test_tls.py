"""TLS on the API (issue 44): a node started with a `skulk tls self-signed` pair serves https that the openai
client reads when it trusts the certificate (models, then a chat on the placed demo model), and nothing over
plain http or to a client that does not trust it (`skulk diag --ca` reads it); two nodes sharing the pair form
one cluster, which needs their topology probes (https, verified against the shared cert) to succeed, and a
cluster diagnostics fan-out over https reads both; a worker stages a model from the store over https."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from skulk.diagnostics.cli import main as diag_main
from skulk.testing.convergence import formed
from skulk.testing.nodes import free_port
from skulk.tls import write_pair
from tests.fake_hub import write_random_model

from .harness import Cluster, instance_ready, place, place_and_wait, wait_until

pytestmark = pytest.mark.timeout(240)
DEMO = "skulk/tiny-random-llama"
MODEL = "org/tiny-store"


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
        _models_cli_reads_it(node.url, cert, tmp_path)
    finally:
        cluster.print_logs()
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _models_cli_reads_it(url: str, cert: Path, tmp_path: Path) -> None:
    """`skulk models list --ca` reads the https node; without the CA it says the handshake failed (and a download
    does not fall back to downloading on this machine, as it would when no node answers)."""
    def models(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "skulk", "models", *args, "--url", url], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env={**os.environ, "SKULK_TLS_CA": ""})

    listed = models("list", "--ca", str(cert))
    assert listed.returncode == 0 and DEMO in listed.stdout, listed.stderr
    for command in (("list",), ("download", DEMO)):
        refused = models(*command)
        assert refused.returncode == 1 and "TLS handshake" in refused.stderr, refused.stderr
        assert "downloaded" not in refused.stderr


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


def test_a_worker_stages_from_the_store_over_https(tmp_path: Path) -> None:
    """The store's file server serves https with the node's pair: a worker asks the store host (API over https),
    stages its files from the store port over https (no plain-http splice) and serves a chat from them."""
    cert, key = write_pair(tmp_path / "tls", [])
    store_path, port = tmp_path / "store", free_port()
    write_random_model(store_path, MODEL, shards=2, layers=4)
    for index, path in ((0, store_path), (1, tmp_path / "worker-store")):
        home = tmp_path / f"node{index}"
        home.mkdir(parents=True)
        (home / "skulk.yaml").write_text(
            "model_store:\n  enabled: true\n  store_host: store\n  store_address: 127.0.0.1\n"
            f"  store_port: {port}\n  store_path: {path}\n  download: {{allow_hf_fallback: false}}\n")
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    cluster = Cluster(tmp_path)
    try:
        host = cluster.start(1, tls=(cert, key), extra_env={"SKULK_NODE_NAME": "store", **offline})[0]
        worker = cluster.start(1, tls=(cert, key), extra_env={"SKULK_NODE_NAME": "worker", **offline})[0]
        wait_until(lambda: formed([host, worker]), 60, "two nodes to form one cluster")
        status, added = host.post("/models/add", {"model_id": MODEL})
        assert status == 200 and added["downloaded"], added
        assert worker.get("/store/health")["store_reachable"] is True
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/registry", timeout=5, trust_env=False)
        instance_id = place(host, MODEL, min_nodes=2)["instanceId"]
        wait_until(lambda: instance_ready(host, instance_id), 90, "the instance to be ready", worker.log_tail)
        progress = host.get("/state")["downloads"][worker.node_id][MODEL]
        assert (progress["status"], progress["source"]) == ("Completed", "store")
        status, reply = worker.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, reply
    finally:
        cluster.print_logs()
        assert cluster.stop_all() == [], "runner processes outlived their node"
