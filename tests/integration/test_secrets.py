"""No secret leaves a node (issue 27): two nodes started with the cluster key, an API key and an admin key on
their command lines and a Hugging Face token in their environment serve chats with tracing on; then every GET
route the API documents (as admin, on both nodes), every file under both homes and every line both nodes wrote is
searched for the four secrets. An HTTP admin key must not yield the cluster key."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from skulk.cluster.seal import generate_key
from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait

MODEL = "skulk/tiny-random-llama"
CLUSTER_KEY = generate_key()
API_KEY = f"api-{uuid.uuid4().hex}"
ADMIN_KEY = f"admin-{uuid.uuid4().hex}"
HF_TOKEN = f"hf_{uuid.uuid4().hex}"
SECRETS = {"cluster key": CLUSTER_KEY, "API key": API_KEY, "admin key": ADMIN_KEY, "HF token": HF_TOKEN}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
pytestmark = pytest.mark.timeout(300)


def leaks(text: str) -> list[str]:
    return [name for name, secret in SECRETS.items() if secret in text]


def get_routes(node: LocalNode) -> list[str]:
    """Every GET path the node documents that takes no path parameter."""
    spec = httpx.get(node.url + "/openapi.json", headers=ADMIN, timeout=10).json()
    return sorted(p for p, ops in spec["paths"].items() if "get" in ops and "{" not in p)


def surfaces(node: LocalNode) -> dict[str, str]:
    texts: dict[str, str] = {}
    for path in get_routes(node):
        if path.startswith(("/v1/events", "/v1/logs/stream")):
            continue  # endless streams; /v1/events' snapshot is /state
        try:
            reply = httpx.get(node.url + path, headers=ADMIN, timeout=30)
        except httpx.HTTPError as exc:
            texts[path] = f"(no answer: {exc})"
            continue
        texts[path] = reply.text
    traces: Any = httpx.get(node.url + "/v1/traces", headers=ADMIN, timeout=30).json()
    for trace in (traces.get("traces", []) if isinstance(traces, dict) else traces)[:3]:
        task = trace.get("taskId")
        texts[f"/v1/traces/{task}"] = httpx.get(f"{node.url}/v1/traces/{task}", headers=ADMIN, timeout=30).text
    return texts


def files_under(home: Path) -> dict[str, str]:
    return {str(p): p.read_bytes().decode(errors="replace") for p in home.rglob("*")
            if p.is_file() and p.stat().st_size < 64 * 1024 * 1024 and "models" not in p.parts}


def test_no_secret_on_any_surface(tmp_path: Path) -> None:
    flags = ["--cluster-key", CLUSTER_KEY, "--api-key", API_KEY, f"--admin-key={ADMIN_KEY}"]
    env = {"HF_TOKEN": HF_TOKEN, "SKULK_LOGGING_ENABLED": "1"}
    cluster = Cluster(tmp_path, extra_env=env)
    try:
        nodes = cluster.form(2, headers=ADMIN, extra_args=flags)
        place_and_wait(nodes[0])
        assert httpx.put(nodes[0].url + "/v1/tracing", json={"enabled": True}, headers=ADMIN,
                          timeout=10).status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for node in nodes:
            reply = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=60,
                               headers={"Authorization": f"Bearer {API_KEY}"})
            assert reply.status_code == 200, reply.text
        wrong = httpx.get(nodes[1].url + "/state", headers={"Authorization": f"Bearer {CLUSTER_KEY}"}, timeout=10)
        assert wrong.status_code == 401  # a key offered in the wrong place is not echoed anywhere either
        found: dict[str, list[str]] = {}
        seen = 0
        for index, node in enumerate(nodes):
            for path, text in surfaces(node).items():
                seen += 1
                if leaked := leaks(text):
                    found[f"node{index} GET {path}"] = leaked
        assert seen > 20, f"only {seen} surfaces read"
        cluster.stop_all()
        for index, node in enumerate(nodes):
            for path, text in files_under(node.home).items():
                if leaked := leaks(text):
                    found[f"node{index} file {path}"] = leaked
            if leaked := leaks("\n".join(node.output)):
                found[f"node{index} output"] = leaked
        assert not found, found
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"
