"""Clients written for real Skulk and the common SDKs, against one real node (one module-scoped fixture).

The node's instance is placed the way a Skulk client places one: GET /instance/previews, take the widest
preview whose error is null, POST its `instance` to /instance. Responses are checked field for field against
recorded Skulk-shaped ones (skulk_wire/)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from skulk.testing.nodes import LocalNode
from skulk.testing.wire_shape import shape_mismatches

from .harness import Cluster, instance_ready, wait_until

MODEL = "skulk/tiny-random-llama"
WIRE = Path(__file__).parent / "skulk_wire"
pytestmark = pytest.mark.timeout(180)


def recorded(name: str) -> Any:
    return json.loads((WIRE / name).read_text())


@dataclass
class Served:
    node: LocalNode
    preview: dict[str, Any]
    placed: dict[str, Any]


def place_through_previews(node: LocalNode) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a Skulk client does: the widest preview that can be placed, sent back as it came (right after start
    the node's memory reading may not be in yet: every preview then says so in its error)."""

    def usable() -> list[dict[str, Any]]:
        previews = node.get(f"/instance/previews?model_id={MODEL}")["previews"]
        return [p for p in previews if p["error"] is None and p["instance"] is not None]

    widest = max(wait_until(usable, 30, "a placeable preview"), key=lambda p: len(p["memory_delta_by_node"]))
    with node.client() as client:
        reply = client.post("/instance", json={"instance": widest["instance"]})
        assert reply.status_code == 200, reply.text
    return widest, reply.json()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("clients")
    (root / "node0").mkdir()
    (root / "node0" / "skulk.yaml").write_text("tracing:\n  retention_days: 2\n")
    cluster = Cluster(root, extra_env={"SKULK_FAULT": "script:reply"})  # SKULK_SCRIPT<<<…>>> scripts a reply
    try:
        (node,) = cluster.start(1)
        preview, placed = place_through_previews(node)
        instance_id = preview["instance"]["MlxRingInstance"]["instanceId"]
        wait_until(lambda: instance_ready(node, instance_id), 90, "the previewed instance to be ready")
        yield Served(node, preview, placed)
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8, **extra}


# ------------------------------------------------------------------------------------ Skulk's wire contract


def test_previews_round_trip_in_skulks_shape(served: Served) -> None:
    assert shape_mismatches(recorded("previews.json")["previews"][0], served.preview) == []
    assert shape_mismatches(recorded("create_instance.json"), served.placed) == []
    state = served.node.get("/state")
    assert served.preview["instance"]["MlxRingInstance"]["instanceId"] in state["instances"]
    with served.node.client() as client:
        everything = client.get("/instance/previews", params={"model_id": MODEL}).json()
        refused = [p for p in everything["previews"] if p["instance_meta"] == "MlxJaccl"]
        assert refused and all(isinstance(p["error"], str) and p["instance"] is None for p in refused)
        assert shape_mismatches(recorded("preview_refused.json"), refused[0]) == []
        again = client.post("/instance", json={"instance": served.preview["instance"]})
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        bogus = client.post("/instance", json={"instance": {"MlxRingInstance": {"instanceId": "x"}}})
        assert bogus.status_code == 422


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_beyond_the_context_is_refused_before_streaming(served: Served, stream: bool) -> None:
    started = time.monotonic()
    with served.node.client() as client:
        reply = client.post("/v1/chat/completions", json=chat(max_tokens=1_000_000, stream=stream))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded" and "max_tokens" in error["message"]
    assert time.monotonic() - started < 10


def test_stream_ends_with_a_generation_stats_comment(served: Served) -> None:
    with served.node.client() as client, client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        lines = [line for line in r.iter_lines() if line]
    comments = [line for line in lines if line.startswith(": generation_stats ")]
    assert len(comments) == 1 and lines[-1] == "data: [DONE]" and lines[-2] == comments[0]  # Skulk's place
    assert lines[-3].startswith(": serving_stats ")  # ours comes before it, so Skulk's readers see theirs last
    stats = json.loads(comments[0].removeprefix(": generation_stats "))
    assert shape_mismatches(recorded("generation_stats.json"), stats) == []
    assert stats["prompt_tokens"] > 0 and 1 <= stats["generation_tokens"] <= 8 and stats["prompt_tps"] > 0
    assert stats["peak_memory_usage"]["inBytes"] > 0


def test_bench_chat_completions(served: Served) -> None:
    with served.node.client() as client:
        reply = client.post("/bench/chat/completions", json=chat(max_tokens=6, stream=True))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert shape_mismatches(recorded("bench_chat_completion.json"), body) == []
    assert body["generation_stats"]["generation_tokens"] == body["usage"]["completion_tokens"]
    assert body["serving_batches"] >= 1 and body["in_flight_at_admission"] >= 0


def test_state_has_node_system_and_resources(served: Served) -> None:
    state = served.node.get("/state")
    assert shape_mismatches(recorded("state_nodes.json"), state) == []
    assert state["nodeSystem"][served.node.node_id]["accelerator"]["vendor"] in ("cpu", "nvidia", "amd", "apple")
    assert "torch" in state["nodeResources"][served.node.node_id]["backends"]


def test_config_get_and_put(served: Served) -> None:
    with served.node.client() as client:
        got = client.get("/config").json()
        assert shape_mismatches(recorded("config.json"), got) == []
        assert got["config"] == {"tracing": {"retention_days": 2}}
        assert got["effective"]["tracing"]["retention_days"] == 2 and got["effective"]["api_port"] > 0
        same = client.put("/config", json={"config": got["config"]})
        assert same.status_code == 200 and same.json()["changed"] == []
        changed = client.put("/config", json={"tracing": {"retention_days": 5}})
        assert changed.status_code == 400 and "restart" in changed.json()["error"]["message"]
        assert "tracing.retention_days" in changed.json()["error"]["message"]
        invalid = client.put("/config", json={"tracing": {"retention_dayz": 5}})
        assert invalid.status_code == 422 and "retention_dayz" in invalid.json()["error"]["message"]
        assert client.get("/config").json()["config"] == got["config"]


def test_n_other_than_one_is_refused(served: Served) -> None:
    with served.node.client() as client:
        reply = client.post("/v1/chat/completions", json=chat(n=2))
        assert reply.status_code == 400 and "n=1" in reply.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat(n=1)).status_code == 200


def _open_tasks(node: LocalNode) -> dict[str, str]:
    tasks = node.get("/state")["tasks"]
    return {t["ChatCompletion"]["commandId"]: t["ChatCompletion"]["taskStatus"] for t in tasks.values()}


def test_non_streaming_disconnect_cancels(served: Served) -> None:
    before = set(_open_tasks(served.node))
    # greedy: the demo model never samples its end token on this prompt, so the reply takes all 1900 tokens; top-20
    # logprobs only make each token cost more (2-4 s on this 2-core machine). With ~1,000 chunks a second arriving,
    # the cancel nearly always lands as a chunk does: on a loaded machine this test caught ChunkStream.next
    # dropping such a cancel (1 run in 5), and the reply ran to its end
    body = chat(max_tokens=1900, temperature=0.0, messages=[{"role": "user", "content": "go on"}], logprobs=True,
                top_logprobs=20)
    # only the read is short: a connect or write slowed by a loaded machine must not count as the disconnect
    patience = httpx.Timeout(10.0, read=0.75)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=served.node.url, timeout=patience) as client:
        client.post("/v1/chat/completions", json=body)
    new = wait_until(lambda: set(_open_tasks(served.node)) - before, 10, "the request's task to appear")
    (command_id,) = new
    ended = wait_until(
        lambda: _open_tasks(served.node)[command_id] not in ("Pending", "Running"), 15, "the abandoned request to end"
    )
    assert ended and _open_tasks(served.node)[command_id] == "Cancelled"


# ------------------------------------------------------------------------------------- the SDKs, unchanged


def test_openai_sdk_completions_and_responses(served: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served.node.url}/v1", api_key="unused", timeout=60)
    legacy = client.completions.create(model=MODEL, prompt="once upon", max_tokens=5)
    assert legacy.choices[0].finish_reason in ("length", "stop")
    assert legacy.usage is not None and legacy.usage.completion_tokens <= 5
    pieces = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=5, stream=True))
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")
    reply = client.responses.create(model=MODEL, input="hi", max_output_tokens=6)
    assert reply.status in ("completed", "incomplete") and reply.usage and reply.usage.output_tokens <= 6
    assert reply.output_text == reply.output[0].content[0].text  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if events[-1].response.status == "incomplete"  # type: ignore[union-attr]
                         else "response.completed")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text  # type: ignore[union-attr]


CLAUDE_ORDER = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                "message_delta", "message_stop"]


def test_anthropic_sdk_messages(served: Served) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=served.node.url, api_key="unused", timeout=60)
    message = client.messages.create(
        model=MODEL, max_tokens=6, system="be brief", stop_sequences=["\n\n"],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    )
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert message.usage.input_tokens > 0 and 1 <= message.usage.output_tokens <= 6
    with client.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1 and final.content[0].text == text  # type: ignore[union-attr]
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with served.node.client() as raw, raw.stream("POST", "/v1/messages", json=body) as reply:
        kinds = [line.removeprefix("event: ") for line in reply.iter_lines() if line.startswith("event: ")]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert collapsed == CLAUDE_ORDER, kinds
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello"}])
    plain = client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hello"}])
    assert counted.input_tokens == plain.usage.input_tokens > 0


def test_anthropic_errors_in_anthropics_shape(served: Served) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=served.node.url, api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nobody/none", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with served.node.client() as raw:
        no_max = raw.post("/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert no_max.status_code == 400 and no_max.json()["type"] == "error"
        assert "max_tokens" in no_max.json()["error"]["message"]
        too_long = raw.post("/v1/messages", json={"model": MODEL, "max_tokens": 1_000_000,
                                                  "messages": [{"role": "user", "content": "x"}]})
        assert too_long.status_code == 400 and too_long.json()["error"]["type"] == "invalid_request_error"


def test_ollama_client(served: Served) -> None:
    import ollama

    client = ollama.Client(host=f"{served.node.url}/ollama", timeout=60)
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 5})
    assert reply.done and reply.done_reason in ("stop", "length") and reply.message.role == "assistant"
    assert reply.eval_count is not None and 1 <= reply.eval_count <= 5 and (reply.prompt_eval_count or 0) > 0
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                             options={"num_predict": 5, "temperature": 0}))
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    generated = client.generate(model=MODEL, prompt="why", options={"num_predict": 4})
    assert generated.done and generated.eval_count is not None and generated.eval_count <= 4
    assert MODEL in [m.model for m in client.list().models]
    assert MODEL in [m.model for m in client.ps().models]
    assert client.show(MODEL).details is not None
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nobody/none", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404
    with served.node.client() as raw:
        assert raw.get("/ollama/api/version").json()["version"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}}
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_openai_tool_call_round_trip(served: Served) -> None:
    """The demo model's Qwen-style template renders the tools and the tool result; its reply is scripted
    (SKULK_FAULT=script:reply) so the real parser and streaming paths see a real tool call."""
    import openai

    client = openai.OpenAI(base_url=f"{served.node.url}/v1", api_key="unused", timeout=60)
    ask: list[Any] = [{"role": "user", "content": f"Weather in Paris? SKULK_SCRIPT<<<{CALL_TEXT}>>>"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=300)
    assert reply.usage and plain.usage and reply.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # tools rendered
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content == CALL_TEXT  # no tools: text

    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER, max_tokens=300,
                                                 stream=True))
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in streamed) == ""
    calls = [tc for d in streamed for tc in d.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    follow = [*ask, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny SKULK_SCRIPT<<<It is sunny in Paris.>>>"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=WEATHER, max_tokens=300)
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.usage and answer.usage.prompt_tokens > reply.usage.prompt_tokens + len(CALL_TEXT) // 2


def test_json_mode_and_response_format_validation(served: Served) -> None:
    schema = {"name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    with served.node.client() as client:
        asked = chat(response_format={"type": "json_object"}, max_tokens=2)
        plain = client.post("/v1/chat/completions", json=chat(max_tokens=2)).json()
        json_mode = client.post("/v1/chat/completions", json=asked).json()
        assert json_mode["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the JSON instruction
        with_schema = client.post("/v1/chat/completions", json=chat(
            response_format={"type": "json_schema", "json_schema": schema}, max_tokens=2)).json()
        assert with_schema["usage"]["prompt_tokens"] > json_mode["usage"]["prompt_tokens"]  # and the schema
        for bad, says in (({"type": "xml"}, "response_format"),
                          ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, "JSON Schema"),
                          ({"type": "json_schema", "json_schema": {"schema": {}}}, "name")):
            reply = client.post("/v1/chat/completions", json=chat(response_format=bad))
            assert reply.status_code == 422 and says in reply.json()["error"]["message"], reply.text


def test_anthropic_tool_use_round_trip(served: Served) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=served.node.url, api_key="unused", timeout=60)
    tools: list[Any] = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    ask: list[Any] = [{"role": "user", "content": f"Weather in Paris? SKULK_SCRIPT<<<{CALL_TEXT}>>>"}]
    message = client.messages.create(model=MODEL, max_tokens=300, tools=tools, messages=ask)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    with client.messages.stream(model=MODEL, max_tokens=300, tools=tools, messages=ask) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]  # no empty text
    assert final.content[0].input == {"city": "Paris"}  # type: ignore[union-attr]
    follow = [*ask, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore[union-attr]
                                            "content": "sunny SKULK_SCRIPT<<<Sunny in Paris.>>>"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=300, tools=tools, messages=follow)
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "Sunny in Paris."  # type: ignore[union-attr]


def test_ollama_tool_calls(served: Served) -> None:
    import ollama

    client = ollama.Client(host=f"{served.node.url}/ollama", timeout=60)
    ask: list[Any] = [{"role": "user", "content": f"Weather in Paris? SKULK_SCRIPT<<<{CALL_TEXT}>>>"}]
    reply = client.chat(model=MODEL, messages=ask, tools=WEATHER, options={"num_predict": 300})
    calls = reply.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    parts = list(client.chat(model=MODEL, messages=ask, tools=WEATHER, stream=True, options={"num_predict": 300}))
    assert "".join(p.message.content or "" for p in parts) == ""
    streamed = [c for p in parts for c in p.message.tool_calls or []]  # in the line that closed it, as Ollama's
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [("get_weather", {"city": "Paris"})]
    follow = [*ask, reply.message, {"role": "tool", "content": "sunny SKULK_SCRIPT<<<Sunny.>>>"}]
    answer = client.chat(model=MODEL, messages=follow, tools=WEATHER, options={"num_predict": 300})
    assert answer.message.content == "Sunny." and not answer.message.tool_calls


# ------------------------------------------------------------------------------- logprobs and tool_choice


def _first_step_logprobs(prompt_tokens: int, models_dir: Path) -> torch.Tensor:
    """What the node's first token must report: log_softmax of the demo model's last logits over the prompt,
    computed here with the model loaded in the test process (the demo model is generated identically)."""
    from skulk.engines.torch.cache import StepBatch
    from skulk.engines.torch.loader import load_model
    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.models.demo import ensure_demo_model
    from skulk.types.chat import ChatMessage

    demo = ensure_demo_model(models_dir)
    prompt = ChatTokenizer(demo).encode_chat([ChatMessage(role="user", content="ping")])
    assert len(prompt) == prompt_tokens
    model = load_model(demo)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), StepBatch.build(torch.arange(len(prompt)).unsqueeze(0), 0),
                       model.make_cache(1, len(prompt)))
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


def _check_entries(entries: list[Any], top: int) -> None:
    for entry in entries:
        alternatives = entry.top_logprobs
        assert entry.logprob <= 0 and len(alternatives) == top and entry.bytes == list(entry.token.encode())
        values = [a.logprob for a in alternatives]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert entry.token == alternatives[0].token and entry.logprob == pytest.approx(values[0])  # greedy


def test_openai_logprobs(served: Served, tmp_path: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served.node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    ask: list[Any] = [{"role": "user", "content": "ping"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and reply.usage is not None
    assert len(logprobs.content) == reply.usage.completion_tokens
    _check_entries(logprobs.content, 3)
    expected = _first_step_logprobs(reply.usage.prompt_tokens, tmp_path)
    first = logprobs.content[0]
    assert first.logprob == pytest.approx(expected.max().item(), abs=1e-3)
    assert [a.logprob for a in first.top_logprobs] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-3)

    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in logprobs.content]
    no_top = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, logprobs=True)
    assert no_top.choices[0].logprobs and all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content or [])
    assert client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, logprobs=True, top_logprobs=21)

    legacy = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(v is not None and v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    pieces = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0,
                                            logprobs=2, stream=True))
    assert [t for p in pieces if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens or []] == lp.tokens

    asked: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, "temperature": 0}
    response = client.responses.create(model=MODEL, input="ping", max_output_tokens=4, **asked)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert response.usage and len(part.logprobs or []) == response.usage.output_tokens  # type: ignore[union-attr]
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in part.logprobs or [])  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input="ping", max_output_tokens=4, stream=True, **asked))
    streamed_lp = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]  # type: ignore[union-attr]
    assert [e.token for e in streamed_lp] == [e.token for e in part.logprobs or []]  # type: ignore[union-attr]


WHEN: Any = {"type": "function", "function": {"name": "get_time", "description": "Time in a city", "parameters": CITY}}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
SHORT_CALL = '<tool_call>{"name":"get_weather"}</tool_call>'


def test_openai_tool_choice_required_and_named(served: Served) -> None:
    """Short scripted replies and prompts (each request here prefills the tools): the forced paths, not the parser."""
    import openai

    client = openai.OpenAI(base_url=f"{served.node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    calls: list[Any] = [{"role": "user", "content": f"SKULK_SCRIPT<<<{SHORT_CALL}>>>"}]
    text: list[Any] = [{"role": "user", "content": "SKULK_SCRIPT<<<No.>>>"}]
    required = client.chat.completions.create(model=MODEL, messages=calls, tools=WEATHER, tool_choice="required",
                                              max_tokens=100)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.tool_calls
    named = list(client.chat.completions.create(model=MODEL, messages=calls, tools=[*WEATHER, WHEN],
                                                tool_choice=NAMED, max_tokens=100, stream=True))
    assert [tc.function.name for c in named if c.choices for tc in c.choices[0].delta.tool_calls or []] == [  # type: ignore[union-attr]
        "get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in named if c.choices) == ""  # held whole
    # a scripted reply escapes the constraint (its tokens are forced, not sampled): the check after it still holds,
    # with a 422 no SDK retries
    with pytest.raises(openai.UnprocessableEntityError) as unmet:
        client.chat.completions.create(model=MODEL, messages=text, tools=WEATHER, tool_choice="required", max_tokens=9)
    assert unmet.value.code == "tool_choice_unmet" and "no complete tool call" in unmet.value.message
    with pytest.raises(openai.APIError, match="no complete tool call"):
        list(client.chat.completions.create(model=MODEL, messages=text, tools=WEATHER, tool_choice="required",
                                            max_tokens=9, stream=True))
    wrong: list[Any] = [{"role": "user", "content": 'SKULK_SCRIPT<<<<tool_call>{"name":"get_time"}</tool_call>>>>'}]
    with pytest.raises(openai.UnprocessableEntityError, match="called get_time, not get_weather"):
        client.chat.completions.create(model=MODEL, messages=wrong, tools=[*WEATHER, WHEN], tool_choice=NAMED,
                                       max_tokens=100)
    for bad in ({"type": "function", "function": {"name": "nope"}}, {"type": "web"}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model=MODEL, messages=calls, tools=WEATHER, tool_choice=bad, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=MODEL, messages=calls, tool_choice="required", max_tokens=2)


def test_responses_function_tools(served: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served.node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    tools: list[Any] = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                         "parameters": CITY}]
    ask: list[Any] = [{"role": "user", "content": f"SKULK_SCRIPT<<<{SHORT_CALL}>>>"}]
    reply = client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=100)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {}  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input=ask, tools=tools, max_output_tokens=100, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], kinds
    final = events[-1].response  # type: ignore[union-attr]
    assert [(i.type, i.name) for i in final.output] == [("function_call", "get_weather")]  # type: ignore[union-attr]
    follow = [*ask, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
               "output": "SKULK_SCRIPT<<<It is sunny.>>>"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=tools, max_output_tokens=100)
    assert answer.output_text == "It is sunny." and answer.usage and reply.usage
    assert answer.usage.input_tokens > reply.usage.input_tokens  # the call and its output went into the template
    text_events = list(client.responses.create(model=MODEL, input=follow, tools=tools, max_output_tokens=100,
                                               stream=True))
    assert "".join(e.delta for e in text_events if e.type == "response.output_text.delta") == "It is sunny."  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}], max_output_tokens=2)  # type: ignore[list-item]


def test_anthropic_forced_tool_choice(served: Served) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=served.node.url, api_key="unused", timeout=60, max_retries=0)
    tools: list[Any] = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    ask: list[Any] = [{"role": "user", "content": f"SKULK_SCRIPT<<<{SHORT_CALL}>>>"}]
    named = client.messages.create(model=MODEL, max_tokens=100, tools=tools, messages=ask,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert named.stop_reason == "tool_use" and [b.type for b in named.content] == ["tool_use"]
    text: list[Any] = [{"role": "user", "content": "SKULK_SCRIPT<<<No.>>>"}]
    with pytest.raises(anthropic.UnprocessableEntityError, match="no complete tool call"):
        client.messages.create(model=MODEL, max_tokens=9, tools=tools, messages=text, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model=MODEL, max_tokens=3, tools=tools, messages=text,
                               tool_choice={"type": "tool", "name": "nope"})


def test_ollama_logprobs(served: Served) -> None:
    import ollama

    client = ollama.Client(host=f"{served.node.url}/ollama", timeout=60)
    ask = [{"role": "user", "content": "ping"}]
    greedy = {"num_predict": 3, "temperature": 0}
    reply = client.chat(model=MODEL, messages=ask, options=greedy, logprobs=True, top_logprobs=2)
    entries = reply.logprobs or []
    assert len(entries) == reply.eval_count and all(e.logprob <= 0 for e in entries)
    for e in entries:
        top = [t.logprob for t in e.top_logprobs or []]
        assert len(top) == 2 and top == sorted(top, reverse=True) and e.logprob == pytest.approx(top[0])
    parts = list(client.chat(model=MODEL, messages=ask, options=greedy, logprobs=True, top_logprobs=2, stream=True))
    assert [(e.token, e.logprob) for p in parts for e in p.logprobs or []] == [(e.token, e.logprob) for e in entries]
    generated = client.generate(model=MODEL, prompt="ping", options=greedy, logprobs=True)
    assert generated.logprobs and len(generated.logprobs) == generated.eval_count
    assert client.chat(model=MODEL, messages=ask, options=greedy).logprobs is None
