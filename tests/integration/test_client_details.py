"""The client API details of issue 29 against one real node with the official SDKs (openai, anthropic, ollama):
Anthropic's model list and tool_use streams, the Responses API's stored state, Ollama's model facts, stream and
durations, and /api/pull through the model store from a local stand-in for the hub."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from skulk.api.model_facts import parameter_size
from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub, write_random_model

from .harness import Cluster, place_and_wait, wait_until

MODEL = "skulk/tiny-random-llama"
PULLED = "org/pulled"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    root = tmp_path_factory.mktemp("details")
    write_random_model(root / "hub", PULLED, shards=2)
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root, extra_env={"SKULK_FAULT": "script:reply", "HF_ENDPOINT": hub.url})
    try:
        (started,) = cluster.start(1)
        wait_until(lambda: any(p["error"] is None for p in started.get(f"/instance/previews?model_id={MODEL}")[
            "previews"]), 30, "the node's memory reading (a placeable preview)")
        place_and_wait(started, MODEL)
        yield started
    finally:
        hub.kill()
        assert cluster.stop_all() == [], "runner processes outlived their node"


# ------------------------------------------------------------------------------------------------- Anthropic


def test_anthropic_models_list_is_anthropics_shape(node: LocalNode) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=node.url, api_key="unused", timeout=60, max_retries=0)
    (model,) = list(client.models.list())
    assert (model.id, model.type, model.display_name) == (MODEL, "model", "tiny-random-llama")
    assert datetime(2020, 1, 1, tzinfo=UTC) < model.created_at <= datetime.now(UTC) + timedelta(seconds=5)
    assert client.models.retrieve(MODEL).created_at == model.created_at  # the files' time, not now
    admits = node.get("/v1/models")["data"][0]["context_length"]
    assert model.max_input_tokens == model.max_tokens == admits > 0


def test_anthropic_stop_sequence_is_named_streamed_and_not(node: LocalNode) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=node.url, api_key="unused", timeout=60, max_retries=0)
    asked = {"model": MODEL, "max_tokens": 64, "stop_sequences": ["9", "3"],
             "messages": [{"role": "user", "content": "Count. SKULK_SCRIPT<<<1 2 3 4 5>>>"}]}
    whole = client.messages.create(**asked)  # type: ignore[call-overload]
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "3")
    assert whole.content[0].text == "1 2 "
    with client.messages.stream(**asked) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "1 2 " and (final.stop_reason, final.stop_sequence) == ("stop_sequence", "3")
    ended = client.messages.create(model=MODEL, max_tokens=64, stop_sequences=["9"],
                                   messages=[{"role": "user", "content": "Hi. SKULK_SCRIPT<<<Hello.>>>"}])
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)


def test_anthropic_streamed_tool_use_has_no_empty_text_block(node: LocalNode) -> None:
    body = {"model": MODEL, "max_tokens": 300, "stream": True,
            "tools": [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}],
            "messages": [{"role": "user", "content": f"Weather? SKULK_SCRIPT<<<{CALL_TEXT}>>>"}]}
    with node.client() as raw, raw.stream("POST", "/v1/messages", json=body) as reply:
        events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines() if line.startswith("data: ")]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "get_weather"
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0]


# ------------------------------------------------------------------------------------------------- Responses


def test_responses_previous_response_id_retrieve_and_store(node: LocalNode) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    first_input = "My name is Ada. SKULK_SCRIPT<<<Hello Ada.>>>"
    first = client.responses.create(model=MODEL, input=first_input, instructions="be brief")
    assert first.output_text == "Hello Ada." and first.to_dict()["store"] is True
    second = client.responses.create(model=MODEL, previous_response_id=first.id, instructions="be brief",
                                     input="What is my name? SKULK_SCRIPT<<<Ada.>>>")
    spelled_out = client.responses.create(model=MODEL, instructions="be brief", input=[
        {"role": "user", "content": first_input}, {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name? SKULK_SCRIPT<<<Ada.>>>"}])
    assert second.previous_response_id == first.id and second.output_text == "Ada."
    assert second.usage and spelled_out.usage and first.usage
    assert second.usage.input_tokens == spelled_out.usage.input_tokens > first.usage.input_tokens

    again = client.responses.retrieve(first.id)
    assert (again.id, again.output_text, again.status) == (first.id, "Hello Ada.", "completed")
    streamed = list(client.responses.create(model=MODEL, input="x SKULK_SCRIPT<<<Streamed.>>>", stream=True))
    stored = client.responses.retrieve(streamed[-1].response.id)  # type: ignore[union-attr]
    assert stored.output_text == "Streamed."

    private = client.responses.create(model=MODEL, input="secret SKULK_SCRIPT<<<Noted.>>>", store=False)
    assert private.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(private.id)
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=private.id, input="and?")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_responses_cut_by_max_output_tokens_is_incomplete_down_to_its_message(node: LocalNode) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    long_input = "Count. SKULK_SCRIPT<<<one two three four five six seven eight nine ten>>>"
    cut = client.responses.create(model=MODEL, input=long_input, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input=long_input, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete"  # type: ignore[union-attr]
    whole = client.responses.create(model=MODEL, input="Hi. SKULK_SCRIPT<<<Hello.>>>")
    assert whole.status == "completed" and whole.output[0].status == "completed"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------- Ollama


def test_ollama_model_facts_are_the_models_not_now(node: LocalNode) -> None:
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    (listed,) = [m for m in client.list().models if m.model == MODEL]
    assert listed.digest and len(listed.digest) == 64 and int(listed.digest, 16) >= 0
    assert listed.details and listed.details.parameter_size
    shown = client.show(MODEL)
    count = (shown.modelinfo or {})["general.parameter_count"]
    assert count > 0 and shown.details and shown.details.parameter_size == parameter_size(count)
    client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    (again,) = [m for m in client.list().models if m.model == MODEL]
    assert again.modified_at == listed.modified_at == shown.modified_at  # the files' time, not the request's
    assert again.digest == listed.digest
    (running,) = client.ps().models
    assert running.digest == listed.digest


def test_ollama_show_reads_the_models_template_and_capabilities(node: LocalNode) -> None:
    import ollama

    from skulk.models.demo import CHATML_TEMPLATE

    shown = ollama.Client(host=f"{node.url}/ollama", timeout=60).show(MODEL)
    assert shown.capabilities == ["completion", "tools"]  # its template has a tools section
    assert shown.template == CHATML_TEMPLATE
    assert shown.details and (shown.details.format, shown.details.quantization_level) == ("safetensors", "F32")


def test_ollama_done_line_repeats_nothing_and_durations_add_up(node: LocalNode) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi SKULK_SCRIPT<<<Hello there, friend.>>>"}]}
    with node.client() as raw, raw.stream("POST", "/ollama/api/chat", json=body) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert [line["done"] for line in lines].count(True) == 1 and lines[-1]["done"]
    assert lines[-1]["message"]["content"] == ""
    assert "".join(line["message"]["content"] for line in lines) == "Hello there, friend."
    with node.client() as raw:
        whole = raw.post("/ollama/api/chat", json={**body, "stream": False}).json()
        generated = raw.post("/ollama/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False,
                                                           "options": {"num_predict": 6}}).json()
    assert whole["message"]["content"] == "Hello there, friend."
    for final in (lines[-1], whole, generated):
        parts = final["load_duration"] + final["prompt_eval_duration"] + final["eval_duration"]
        assert final["total_duration"] >= parts > 0, final


def test_ollama_pull_downloads_through_the_store_with_progress(node: LocalNode) -> None:
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=120)
    progress = list(client.pull(PULLED, stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    downloading = [p for p in progress if p.status == f"downloading {PULLED}"]
    assert downloading and downloading[-1].total and downloading[-1].completed == downloading[-1].total
    assert all(p.digest and p.digest.startswith("sha256:") for p in downloading)
    assert statuses.index("success") > statuses.index(f"downloading {PULLED}")
    assert PULLED in [m.model for m in client.list().models]
    store = Path(node.home) / "models" / "org--pulled"
    assert (store / "model-00002-of-00002.safetensors").is_file()
    assert client.pull(PULLED, stream=False).status == "success"  # already there: at once
    assert client.pull(MODEL, stream=False).status == "success"  # built in: generated where it is placed
    with pytest.raises(ollama.ResponseError) as tag:
        client.pull("llama3:8b")
    assert tag.value.status_code == 400 and "Hugging Face" in tag.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("org/nope", stream=False)
    assert missing.value.status_code == 404


