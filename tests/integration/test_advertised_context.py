"""Every surface that advertises a model's context shows what the server admits (issue 32), over HTTP, one real node.

The demo model (a byte-level tokenizer, 2,048 positions) is placed with max_context 200 and an explicit KV pool,
so prompts stay cheap. For each surface the advertised number N is read; then, for each API family, a prompt
that leaves exactly max_tokens to the context end answers, and one a token longer is refused with the API's own
400 naming N. Token counts come from count_tokens, which must itself agree with the runner's usage."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
N = 200  # the placement's max_context: below the model's 2,048, so the cap is what is advertised
PER_TOKEN = 2 * 8 * 2 * 16 * 4  # the demo model's KV: 8 layers, 2 KV heads of 16, float32
POOL = 4 << 20  # 2,048 positions
M = 8  # max_tokens of the admitted/refused pairs
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalNode, str]]:
    cluster = Cluster(tmp_path_factory.mktemp("context"))
    try:
        (node,) = cluster.start(1)
        wait_until(lambda: node.node_id in (node.get("/state") or {}).get("nodeMemory", {}), 60, "memory info")
        instance_id = place_and_wait(node, MODEL, max_context=N, kv_cache_gb=POOL / 2**30)
        yield node, instance_id
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def count(node: LocalNode, text: str) -> tuple[int, Any]:
    status, body = node.post("/v1/messages/count_tokens", {"model": MODEL, "messages": messages(text)})
    return status, body


def text_of(node: LocalNode, tokens: int) -> str:
    """A user message whose chat prompt is exactly `tokens` tokens (the tokenizer is one token per byte)."""
    status, body = count(node, "x")
    assert status == 200, body
    overhead = body["input_tokens"] - 1
    return "x" * (tokens - overhead)


def test_the_placement_sets_the_instances_context_and_each_ranks_pool(served: tuple[LocalNode, str]) -> None:
    node, instance_id = served
    instance = node.get(f"/instance/{instance_id}")["MlxRingInstance"]
    assert instance["contextLength"] == N
    assert list(instance["kvCacheBytes"].values()) == [POOL]
    with node.client() as client:
        previews = client.get("/instance/previews", params={"model_id": MODEL, "max_context": 100000,
                                                            "kv_cache_gb": POOL / 2**30}).json()["previews"]
    usable = [p for p in previews if p["error"] is None]
    assert usable and all(p["context_length"] == 2048 for p in usable), "capped by max_position_embeddings"
    assert all(list(p["kv_cache_bytes_by_node"].values()) == [POOL] for p in usable)


def test_a_pool_that_cannot_fit_is_a_typed_400_saying_so(served: tuple[LocalNode, str]) -> None:
    node, _ = served
    status, body = node.post("/place_instance", {"model_id": MODEL, "kv_cache_gb": 60000})
    assert status == 400 and body["error"]["code"] == "InsufficientMemory", body
    assert "KV pool" in body["error"]["message"] and "kv_cache_gb" in body["error"]["message"]
    status, body = node.post("/place_instance", {"model_id": MODEL, "kv_cache_gb": 0.0001})  # 52 positions
    assert status == 400 and body["error"]["code"] == "KvPoolTooSmall", body
    assert "max_context to at most 52" in body["error"]["message"]
    status, body = node.post("/place_instance", {"model_id": MODEL, "max_context": 1})
    assert status == 422, body


def test_every_surface_advertises_the_placed_context(served: tuple[LocalNode, str]) -> None:
    node, _ = served
    (listed,) = [m for m in node.get("/models")["data"] if m["id"] == MODEL]
    assert listed["context_length"] == N
    (openai,) = [m for m in node.get("/v1/models")["data"] if m["id"] == MODEL]
    assert openai["context_length"] == openai["max_model_len"] == N
    assert node.get(f"/v1/models/{MODEL}")["context_length"] == N
    status, show = node.post("/ollama/api/show", {"model": MODEL})
    assert status == 200 and show["model_info"]["llama.context_length"] == N
    (running,) = [m for m in node.get("/ollama/api/ps")["models"] if m["name"] == MODEL]
    assert running["context_length"] == N


def test_count_tokens_admits_n_minus_one_and_refuses_n_naming_it(served: tuple[LocalNode, str]) -> None:
    node, _ = served
    status, body = count(node, text_of(node, N - 1))
    assert (status, body["input_tokens"]) == (200, N - 1)
    status, body = count(node, text_of(node, N))
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error"
    assert f"maximum context length is {N} tokens" in body["error"]["message"]


def _openai(node: LocalNode, text: str, max_tokens: int | None) -> tuple[int, Any]:
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    return node.post("/v1/chat/completions", {"model": MODEL, "messages": messages(text), "temperature": 0, **extra})


def _claude(node: LocalNode, text: str, max_tokens: int | None) -> tuple[int, Any]:
    return node.post("/v1/messages", {"model": MODEL, "messages": messages(text), "max_tokens": max_tokens})


def _ollama(node: LocalNode, text: str, max_tokens: int | None) -> tuple[int, Any]:
    return node.post("/ollama/api/chat", {"model": MODEL, "messages": messages(text), "stream": False,
                                          "options": {"num_predict": max_tokens, "temperature": 0}})


def _refusal(family: str, body: Any) -> str:
    """The 400's message in each API's own error shape."""
    if family == "claude":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if family == "ollama":
        assert isinstance(body["error"], str), body
        return body["error"]
    assert body["error"]["code"] == "context_length_exceeded", body
    return body["error"]["message"]


@pytest.mark.parametrize(("family", "send"), [("openai", _openai), ("claude", _claude), ("ollama", _ollama)])
def test_the_advertised_context_is_admitted_and_one_more_token_is_refused(
    served: tuple[LocalNode, str], family: str, send: Any
) -> None:
    node, _ = served
    status, body = send(node, text_of(node, N - M), M)  # prompt + max_tokens == N
    assert status == 200, body
    status, body = send(node, text_of(node, N - M + 1), M)  # N + 1
    assert status == 400, body
    message = _refusal(family, body)
    assert re.search(rf"maximum context length is {N} tokens", message), message


def test_without_max_tokens_the_prompt_may_take_all_but_one_position(served: tuple[LocalNode, str]) -> None:
    node, _ = served
    status, body = _openai(node, text_of(node, N - 1), None)
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == N - 1, "count_tokens counts what the runner counts"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= N
    status, body = _openai(node, text_of(node, N), None)
    assert status == 400 and f"maximum context length is {N} tokens" in body["error"]["message"], body


def test_the_runner_built_its_pool_from_the_placement(served: tuple[LocalNode, str]) -> None:
    node, instance_id = served
    _openai(node, "pool", 2)

    def lookups() -> list[dict[str, Any]]:
        runners = node.get("/v1/diagnostics/node").get("supervisorRunners") or []
        return [e["attrs"] for r in runners if r["instanceId"] == instance_id for e in r["flightRecorder"]
                if e["phase"] == "kv_cache_lookup"]

    attrs = wait_until(lookups, 30, "a kv_cache_lookup entry")[-1]
    assert attrs["kv_blocks"] * attrs["kv_block_size"] * PER_TOKEN == POOL


def test_the_dashboards_catalog_shows_the_placed_context(served: tuple[LocalNode, str]) -> None:
    """In a real browser (as test_dashboard.py drives it): the catalog row of the model reads "context N"; a
    preview on the Placing page (a new placement, no max_context) names the model's own context and the KV pool."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extras)")
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed: apt-get install -y chromium")
    node, _ = served
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(node.url + "/catalog")
            row = page.locator(f"[data-testid=model-row][data-model-id='{MODEL}']")
            sync_api.expect(row).to_contain_text(f"context {N}", timeout=30_000)
            page.get_by_role("link", name="Placing", exact=True).click()
            page.get_by_test_id("place-model").select_option(MODEL)
            fits = page.locator("[data-testid=preview][data-ok=true]").first
            sync_api.expect(fits.get_by_test_id("preview-context")).to_contain_text("2048 tokens", timeout=30_000)
            sync_api.expect(fits).to_contain_text("KV pool")
        finally:
            browser.close()


def test_a_second_instance_with_less_context_lowers_what_every_instance_admits(served: tuple[LocalNode, str]) -> None:
    """Last in the module: a newer instance with max_context 150 beside the first (200). Requests still reach the
    first (the oldest wins ties), whose engine would take 200, yet every surface shows 150 and the first instance
    admits no more: the request carries the advertised context to whichever runner takes it."""
    node, first = served
    smaller = 150
    place_and_wait(node, MODEL, max_context=smaller, kv_cache_gb=POOL / 2**30)
    (listed,) = [m for m in node.get("/models")["data"] if m["id"] == MODEL]
    assert listed["context_length"] == node.get(f"/v1/models/{MODEL}")["context_length"] == smaller
    status, body = _openai(node, text_of(node, smaller - M), M)
    assert status == 200, body
    status, body = _openai(node, text_of(node, smaller - M + 1), M)
    assert status == 400 and f"maximum context length is {smaller} tokens" in body["error"]["message"], body
    status, body = _openai(node, text_of(node, smaller - 1), None)
    assert status == 200 and body["usage"]["total_tokens"] <= smaller, body

    def refused_by_the_first() -> bool:
        runners = node.get("/v1/diagnostics/node").get("supervisorRunners") or []
        return any(e["event"] == "context_length_exceeded" for r in runners if r["instanceId"] == first
                   for e in r["flightRecorder"])

    wait_until(refused_by_the_first, 30, "the first instance's runner to record the refusal")
