"""Embeddings against one real node that has placed the built-in demo embedding model, with the official openai
and ollama clients: shapes, unit norm, determinism, lists, base64, and every refusal in each API's own shape."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait

EMBED = "skulk/tiny-random-embed"
CHAT = "skulk/tiny-random-llama"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    cluster = Cluster(tmp_path_factory.mktemp("embeddings"))
    try:
        (started,) = cluster.start(1)
        place_and_wait(started, EMBED)
        yield started
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def openai_client(node: LocalNode) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_openai_embeddings_are_unit_length_deterministic_and_batch_invariant(node: LocalNode) -> None:
    client = openai_client(node)
    one = client.embeddings.create(model=EMBED, input="The quick brown fox", encoding_format="float")
    assert one.object == "list" and one.model == EMBED and len(one.data) == 1
    vector = np.array(one.data[0].embedding)
    assert one.data[0].index == 0 and one.data[0].object == "embedding" and vector.shape == (384,)
    assert math.isclose(float(np.linalg.norm(vector)), 1.0, abs_tol=1e-5)
    assert one.usage.prompt_tokens == one.usage.total_tokens > 2  # the text's tokens plus [CLS] and [SEP]

    texts = ["first text", "The quick brown fox", "a third, longer text than the others"]
    many = client.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert np.allclose(many.data[1].embedding, vector, atol=1e-5)  # same text, another request, other batch-mates
    assert not np.allclose(many.data[0].embedding, many.data[2].embedding)
    again = client.embeddings.create(model=EMBED, input="The quick brown fox", encoding_format="float")
    assert again.data[0].embedding == one.data[0].embedding  # deterministic, bit for bit

    decoded = client.embeddings.create(model=EMBED, input=texts)  # the SDK asks for base64 and decodes it itself
    assert np.allclose([d.embedding for d in decoded.data], [d.embedding for d in many.data], atol=0)
    assert client.embeddings.create(model=EMBED, input="x", dimensions=384, encoding_format="float").data


def test_base64_is_the_float32_rows(node: LocalNode) -> None:
    with node.client() as http:
        body = {"model": EMBED, "input": ["alpha", "beta"]}
        floats = http.post("/v1/embeddings", json=body).json()
        packed = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
        ids = http.post("/v1/embeddings", json={"model": EMBED, "input": [2, 10, 3]}).json()
    for f, b in zip(floats["data"], packed["data"], strict=True):
        assert np.frombuffer(base64.b64decode(b["embedding"]), "<f4").tolist() == f["embedding"]
    assert ids["usage"]["prompt_tokens"] == 3 and len(ids["data"][0]["embedding"]) == 384


def test_refusals_say_what_to_fix(node: LocalNode) -> None:
    import openai

    client = openai_client(node)
    with pytest.raises(openai.BadRequestError, match=f"cannot embed; models that embed: placed: {EMBED}"):
        client.embeddings.create(model=CHAT, input="hi")
    with pytest.raises(openai.BadRequestError, match=r"embedding model and cannot generate text.*/v1/embeddings"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="gives 384-dimensional vectors"):
        client.embeddings.create(model=EMBED, input="hi", dimensions=128)
    with pytest.raises(openai.BadRequestError, match="at most 512 tokens per input"):
        client.embeddings.create(model=EMBED, input=["ok", "x " * 600])
    with pytest.raises(openai.BadRequestError, match="empty string"):
        client.embeddings.create(model=EMBED, input="")
    with pytest.raises(openai.BadRequestError, match="at most 2048"):
        client.embeddings.create(model=EMBED, input=["x"] * 2049)
    with pytest.raises(openai.NotFoundError, match="unknown"):
        client.embeddings.create(model="nobody/nothing", input="hi")
    with node.client() as http:
        reply = http.post("/v1/embeddings", json={"model": EMBED, "input": [2, 99999, 3]})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "token id 99999" in reply.json()["error"]["message"]


def test_ollama_embed(node: LocalNode) -> None:
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    reply = client.embed(model=EMBED, input=["The quick brown fox", "second"])
    assert reply.model == EMBED and len(reply.embeddings) == 2 and len(reply.embeddings[0]) == 384
    assert reply.prompt_eval_count and reply.prompt_eval_count > 4 and reply.total_duration
    same = openai_client(node).embeddings.create(model=EMBED, input="The quick brown fox", encoding_format="float")
    assert np.allclose(reply.embeddings[0], same.data[0].embedding, atol=1e-5)
    assert len(client.embed(model=EMBED, input="x " * 600).embeddings[0]) == 384  # Ollama truncates by default
    with pytest.raises(ollama.ResponseError, match="at most 512 tokens") as too_long:
        client.embed(model=EMBED, input="x " * 600, truncate=False)
    assert too_long.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="cannot embed") as chat_model:
        client.embed(model=CHAT, input="hi")
    assert chat_model.value.status_code == 400
    shown = client.show(EMBED)
    assert shown.capabilities == ["embedding"]
    with node.client() as http:
        listed = {m["id"]: m for m in http.get("/models").json()["data"]}
    assert listed[EMBED]["tasks"] == ["TextEmbedding"] and listed[CHAT]["tasks"] == ["TextGeneration"]


def test_ollama_legacy_embeddings(node: LocalNode) -> None:
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    legacy = client.embeddings(model=EMBED, prompt="The quick brown fox")
    current = client.embed(model=EMBED, input="The quick brown fox")
    assert len(legacy.embedding) == 384 and np.allclose(legacy.embedding, current.embeddings[0], atol=1e-5)
    with pytest.raises(ollama.ResponseError, match="cannot embed") as chat_model:
        client.embeddings(model=CHAT, prompt="x")
    assert chat_model.value.status_code == 400
