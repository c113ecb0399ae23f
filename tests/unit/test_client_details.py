"""Client API details answered before any runner is asked (issue 29): media parts refused as text-only in each
API's error shape, fields that would change the answer refused instead of ignored, /v1/models listing what is
served (in Anthropic's shape for Anthropic's SDKs), the 404 that says how to place a model, the Responses store's
bounds, and the Ollama facts (parameter size, durations that add up)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from skulk.api.app import create_app
from skulk.api.model_facts import config_parameters, parameter_size, safetensors_parameters
from skulk.api.ollama import _timings
from skulk.api.ollama_pull import OllamaPullRequest, pull_model_id
from skulk.api.response_store import ResponseStore, check_owner, not_found
from skulk.api.security import CURRENT, Access, Principal
from skulk.types.chat import ChatMessage
from skulk.types.chunks import GenerationStats, RequestStats
from skulk.types.errors import ApiError
from skulk.types.ids import InstanceId
from skulk.types.memory import Memory
from skulk.types.state import State

from .factories import CARD, api_services, instance

pytestmark = pytest.mark.timeout(60)
TEXT_ONLY = "this model takes text only"
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.fixture(scope="module")
def client() -> TestClient:
    state = State(instances={InstanceId("inst"): instance()}, model_cards={CARD.model_id: CARD})
    return TestClient(create_app(api_services(state=state)), base_url="http://127.0.0.1")


def _openai_error(reply: Any, status: int, says: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert says in error["message"] and "input_value" not in error["message"] and "union" not in error["message"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, IMAGE_URL]}]}),
    ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "data:,x"}]}]}),
])
def test_an_image_part_is_one_text_only_400_in_openais_shape(client: TestClient, path: str, body: Any) -> None:
    reply = client.post(path, json=body)
    _openai_error(reply, 400, TEXT_ONLY)
    assert reply.json()["error"]["code"] == "text_only" and "content part 1" in reply.json()["error"]["message"]


def test_an_image_is_text_only_in_claudes_and_ollamas_shapes(client: TestClient) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    claude = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]})
    assert claude.status_code == 400 and claude.json()["type"] == "error"
    assert claude.json()["error"]["type"] == "invalid_request_error"
    assert TEXT_ONLY in claude.json()["error"]["message"]
    for path, body in (("/ollama/api/chat", {"model": "m", "messages": [
                           {"role": "user", "content": "what?", "images": ["AAAA"]}]}),
                       ("/ollama/api/generate", {"model": "m", "prompt": "what?", "images": ["AAAA"]})):
        reply = client.post(path, json=body)
        assert reply.status_code == 400 and TEXT_ONLY in reply.json()["error"], reply.text
        assert isinstance(reply.json()["error"], str)


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/messages", {"thinking": {"type": "enabled"}}, "thinking"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ("/v1/messages", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ("/ollama/api/generate", {"raw": True}, "raw"),
    ("/ollama/api/generate", {"suffix": "}"}, "suffix"),
    ("/ollama/api/chat", {"options": {"repeat_penalty": 1.3}}, "repetition penalties"),
    ("/ollama/api/generate", {"options": {"mirostat": 2}}, "mirostat"),
    ("/v1/responses", {"background": True}, "background"),
    ("/v1/responses", {"reasoning": {"effort": "high", "summary": "detailed"}}, "reasoning.summary"),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"suffix": "}"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
])
def test_fields_that_are_not_served_are_refused_not_ignored(
    client: TestClient, path: str, body: dict[str, Any], says: str
) -> None:
    base: dict[str, Any] = {
        "/v1/messages": {"model": "test/model", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        "/ollama/api/chat": {"model": "test/model", "messages": [{"role": "user", "content": "x"}],
                             "options": {"repeat_penalty": 1.0, "num_ctx": 4096}},
        "/ollama/api/generate": {"model": "test/model", "prompt": "x"},
        "/v1/responses": {"model": "test/model", "input": "x"},
        "/v1/chat/completions": {"model": "test/model", "messages": [{"role": "user", "content": "x"}],
                                 "presence_penalty": 0},
        "/v1/completions": {"model": "test/model", "prompt": "x"},
    }[path]
    reply = client.post(path, json={**base, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert message.startswith(says) or says in message, message


def test_thinking_disabled_is_not_refused(client: TestClient) -> None:
    reply = client.post("/v1/messages", json={"model": "nobody/none", "max_tokens": 4, "thinking": {"type": "disabled"},
                                              "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 404, reply.text  # past the refusal: no instance of that model


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "30", [30]])
def test_a_reasoning_budget_that_is_no_positive_integer_is_a_400_in_each_apis_shape(client: TestClient,
                                                                                   bad: Any) -> None:
    """Ollama's `options.reasoning_budget` and Responses' `reasoning.max_tokens`: a 400 naming the field, the
    rule and the API's own way to turn thinking off, in the API's error shape (Ollama's `{"error": "..."}`)."""
    ask = [{"role": "user", "content": "x"}]
    for path, body in (("/ollama/api/chat", {"messages": ask, "options": {"reasoning_budget": bad}}),
                       ("/ollama/api/generate", {"prompt": "x", "options": {"reasoning_budget": bad}})):
        reply = client.post(path, json={"model": "nobody/none", **body})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert isinstance(error, str) and error.startswith("options.reasoning_budget: must be an integer >= 1")
        assert f"got {bad!r}" in error and '"think": false' in error, error
    reply = client.post("/v1/responses", json={"model": "nobody/none", "input": "x", "reasoning": {"max_tokens": bad}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("reasoning.max_tokens: must be an integer >= 1"), error
    assert 'reasoning.effort "none"' in error["message"]


def test_a_positive_reasoning_budget_is_accepted(client: TestClient) -> None:
    ask = [{"role": "user", "content": "x"}]
    for path, body in (("/ollama/api/chat", {"messages": ask, "options": {"reasoning_budget": 64}}),
                       ("/ollama/api/generate", {"prompt": "x", "options": {"reasoning_budget": 1}}),
                       ("/v1/responses", {"input": "x", "reasoning": {"effort": "low", "max_tokens": 64}})):
        reply = client.post(path, json={"model": "nobody/none", **body})
        assert reply.status_code == 404, reply.text  # past validation: no instance of that model


def test_v1_models_lists_what_is_served_in_each_sdks_shape(client: TestClient) -> None:
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["test/model"]
    assert isinstance(listed["data"][0]["created"], int)
    claude = client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert claude["has_more"] is False and claude["first_id"] == claude["last_id"] == "test/model"
    (model,) = claude["data"]
    assert model["type"] == "model" and model["display_name"] == "model"
    assert model["created_at"].endswith("Z")
    one = client.get("/v1/models/test/model", headers={"anthropic-version": "2023-06-01"}).json()
    assert one == model


def test_an_unplaced_model_is_a_404_that_says_how_to_place_it(client: TestClient) -> None:
    demo = "skulk/tiny-random-llama"  # in the catalog, not placed here
    for reply in (client.get(f"/v1/models/{demo}"),
                  client.post("/v1/chat/completions", json={"model": demo, "messages": [
                      {"role": "user", "content": "x"}]})):
        _openai_error(reply, 404, f'POST /place_instance {{"model_id": "{demo}"}}')
    claude = client.get(f"/v1/models/{demo}", headers={"anthropic-version": "2023-06-01"})
    assert claude.status_code == 404 and claude.json()["error"]["type"] == "not_found_error"
    unknown = client.post("/v1/chat/completions", json={"model": "nobody/none", "messages": [
        {"role": "user", "content": "x"}]})
    _openai_error(unknown, 404, "POST /models/add")


def test_responses_unknown_ids_are_404s_in_openais_shape(client: TestClient) -> None:
    for reply in (client.get("/v1/responses/resp_nope"), client.delete("/v1/responses/resp_nope"),
                  client.post("/v1/responses", json={"model": "test/model", "input": "x",
                                                     "previous_response_id": "resp_nope"})):
        _openai_error(reply, 404, "resp_nope")
        assert reply.json()["error"]["code"] == "response_not_found"


def test_the_response_store_keeps_a_bounded_time_count_and_size() -> None:
    now = [0.0]
    store = ResponseStore(max_age_s=10, max_responses=3, max_bytes=10_000, clock=lambda: now[0])
    turn = [ChatMessage(role="user", content="hi")]
    for i in range(4):
        store.put(f"r{i}", "{}", turn)
        now[0] += 1
    assert store.get("r0") is None and len(store) == 3  # the oldest went first
    now[0] = 11.5  # r1 was created at 1: older than 10 s
    assert store.get("r1") is None and store.get("r2") is not None
    store.put("big", "x" * 9_900, turn)
    assert store.get("r2") is None and store.get("big") is not None  # bytes over the bound: oldest out
    store.put("huge", "x" * 20_000, turn)
    assert store.get("huge") is None and store.get("big") is not None  # larger than the store: never kept
    missing = not_found("r0", "previous_response_id", store.max_age_s)
    assert missing.status == 404 and "previous_response_id" in missing.message and "any node" in missing.message


def test_a_stored_response_belongs_to_its_key() -> None:
    store = ResponseStore()
    store.put("resp_a", "{}", [ChatMessage(role="user", content="secret")], owner="key-a")
    viewers = ((Principal(Access.INFERENCE, "key-a"), True), (Principal(Access.INFERENCE, "key-b"), False),
               (Principal(Access.ADMIN, "admin"), True))
    for principal, visible in viewers:
        token = CURRENT.set(principal)
        try:
            seen = check_owner(store.get("resp_a"))
            assert (seen is not None) == visible  # another key's response is not said to exist
            assert seen is None or seen.conversation[0].text == "secret"
        finally:
            CURRENT.reset(token)


def test_parameter_counts_come_from_safetensors_headers(tmp_path: Path) -> None:
    a_bytes = 576 * 49152 * 2
    header = json.dumps({"__metadata__": {},
                         "a": {"dtype": "BF16", "shape": [576, 49152], "data_offsets": [0, a_bytes]},
                         "b": {"dtype": "BF16", "shape": [576], "data_offsets": [a_bytes, a_bytes + 1152]}}).encode()
    with (tmp_path / "model.safetensors").open("wb") as f:  # the data sparse: the header's offsets must fit the file
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + a_bytes + 1152)
    assert safetensors_parameters([tmp_path / "model.safetensors"]) == 576 * 49152 + 576
    smollm2 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9,
               "num_key_value_heads": 3, "intermediate_size": 1536, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(smollm2))
    assert config_parameters(tmp_path / "config.json") == 134_515_008  # the tensors of SmolLM2's GGUF, counted
    assert [parameter_size(n) for n in (134_515_008, 1_543_714_304, 70_553_706_496, 360_000_000, 999)] == [
        "135M", "1.5B", "71B", "360M", "999"]


def test_ollama_durations_never_add_up_to_more_than_the_total() -> None:
    stats = RequestStats(generation=GenerationStats(
        prompt_tps=10.0, generation_tps=2.0, prompt_tokens=50, generation_tokens=9,
        peak_memory_usage=Memory.from_bytes(1)))
    timing = _timings(stats, 50, 9, total_ns=3_000_000_000)  # the rates say 5 s + 4 s; the request took 3 s
    parts = timing["load_duration"] + timing["prompt_eval_duration"] + timing["eval_duration"]
    assert timing["total_duration"] >= parts and timing["eval_duration"] >= 0
    honest = _timings(stats, 50, 9, total_ns=20_000_000_000)
    assert (honest["prompt_eval_duration"], honest["eval_duration"]) == (5_000_000_000, 4_000_000_000)


def test_pull_names_a_hugging_face_model() -> None:
    assert pull_model_id(OllamaPullRequest(model="org/name")) == "org/name"
    with pytest.raises(ApiError) as tag:
        pull_model_id(OllamaPullRequest(model="llama3:8b"))
    assert tag.value.status == 400 and "skulk models import ollama:llama3:8b" in tag.value.message


def test_pull_through_a_store_host_streams_its_progress_and_ends_on_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a store host configured the download runs there: the lines follow its status answers, and a status it
    can no longer give ends the pull with an error line instead of polling forever."""
    import asyncio

    from fastapi.responses import JSONResponse

    from skulk.api import ollama_pull

    answers: list[JSONResponse] = []

    async def store_host(_: Any, method: str, path: str) -> JSONResponse:
        return JSONResponse({"model_id": "org/x"}, status_code=202) if method == "POST" else answers.pop(0)

    async def card(_: Any, model_id: str) -> Any:
        return CARD

    monkeypatch.setattr(ollama_pull, "at_store_host", store_host)
    monkeypatch.setattr(ollama_pull, "known_card", card)
    monkeypatch.setattr(ollama_pull, "POLL_S", 0.0)

    async def lines() -> list[dict[str, Any]]:
        return [line async for line in ollama_pull.pull_lines(api_services(), "org/x")]

    answers[:] = [JSONResponse({"status": "Downloading", "totalBytes": 100, "downloadedBytes": 40}),
                  JSONResponse({"status": "Downloading", "totalBytes": 100, "downloadedBytes": 40}),
                  JSONResponse({"status": "Completed", "totalBytes": 100, "downloadedBytes": 100})]
    got = asyncio.run(lines())
    assert [line["status"] for line in got] == ["pulling manifest", "downloading org/x", "downloading org/x",
                                                "verifying sha256 digest", "writing manifest", "success"]
    assert [(line["total"], line["completed"]) for line in got[1:3]] == [(100, 40), (100, 100)]
    answers[:] = [JSONResponse({"error": {"message": "no download of org/x", "type": "x"}}, status_code=404)]
    failed = asyncio.run(lines())
    assert failed[-1]["error"] == "no download of org/x" and failed[-1]["_status"] == 404
