"""A thinking model's reasoning kept apart from its answer on every API, through a real node: a random checkpoint
with a Qwen3-style thinking template (its `enable_thinking` switch as Qwen3's, and a test-only `open_think`
variable that ends the prompt with `<think>\\n` as DeepSeek-R1's and Qwen3-thinking-2507's templates do), its replies
scripted (SKULK_FAULT=script:reply). The scripted text is tokenized by a byte-level vocabulary without a `<think>`
token, so every tag arrives split across several tokens. One node serves every test of the module."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import LocalNode
from tests.fake_hub import RunningHub, set_chat_template, write_random_model

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL = "org/tiny-thinker"
THINKING_TEMPLATE = (  # Qwen3's generation prompt and reasoning history, over plain ChatML
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{%- endif %}"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- elif open_think is defined and open_think %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
HARMONY_MODEL = "org/tiny-harmony"
HARMONY_TEMPLATE = (  # gpt-oss's message headers and generation prompt, over the demo vocabulary
    "{%- for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    "{#- replies: <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>… -#}"
)
REASONING, ANSWER = "The user greets me. I should greet back.", "Hello there!"
THOUGHT = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
OPENED = f"{REASONING}\n</think>\n\n{ANSWER}"  # the prompt opened the block: only the close tag comes


@contextlib.contextmanager
def thinking_model_served(root: Path) -> Iterator[Cluster]:
    """A random model with the thinking template on a stand-in hub, and a cluster (no node started yet) whose
    engines reply with the scripted text: every runner process is checked gone when the block ends."""
    repo = write_random_model(root / "hub", MODEL)
    set_chat_template(repo, THINKING_TEMPLATE)
    set_chat_template(write_random_model(root / "hub", HARMONY_MODEL), HARMONY_TEMPLATE)
    hub = RunningHub(root / "hub").start()
    cluster = Cluster(root / "nodes", extra_env={"HF_ENDPOINT": hub.url, "SKULK_FAULT": "script:reply"})
    try:
        yield cluster
    finally:
        try:
            assert cluster.stop_all() == [], "runner processes outlived their node"
        finally:
            hub.kill()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    with thinking_model_served(tmp_path_factory.mktemp("reasoning")) as cluster:
        (started,) = cluster.start(1)
        assert started.post("/models/add", {"model_id": MODEL})[0] == 200
        instance_id = place(started, MODEL)["instanceId"]
        wait_until(lambda: instance_ready(started, instance_id), 90, "the instance to be ready", started.log_tail)
        yield started


def ask(script: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Hi! SKULK_SCRIPT<<<{script}>>>"}]


def sse_data(node: LocalNode, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with node.client() as client, client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize(("script", "kwargs"),
                         [(THOUGHT, {}), (OPENED, {"chat_template_kwargs": {"open_think": True}})],
                         ids=["tags", "prompt-opened"])
def test_openai_chat_reasoning_content(node: LocalNode, script: str, kwargs: dict[str, Any]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=ask(script), max_tokens=200,  # type: ignore[arg-type]
                                           extra_body=kwargs)
    message = reply.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == REASONING and message.content == ANSWER
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens or 0
    assert 10 < reasoning_tokens < reply.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=ask(script), max_tokens=200,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True}, extra_body=kwargs)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_thinking_off_the_templates_way_and_a_plain_reply(node: LocalNode) -> None:
    """enable_thinking=false renders Qwen3's closed empty block: the reply is all content, as it is from a model
    that writes no tags at all; a `<think>` in the middle of an answer is just text."""
    text = "No thinking: <think> is a tag."
    for extra in ({"enable_thinking": False}, {}):
        code, reply = node.post("/v1/chat/completions", {"model": MODEL, "messages": ask(text), "max_tokens": 100,
                                                         **extra})
        assert code == 200, reply
        message = reply["choices"][0]["message"]
        assert message["content"] == text and "reasoning_content" not in message, message
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_json_schema_with_a_thinking_template_is_the_answer(node: LocalNode) -> None:
    """A constrained reply holds to its grammar from the first token: no reasoning, the JSON is the content."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    code, reply = node.post("/v1/chat/completions", {"model": MODEL, "messages": ask('{"a": 1}'), "max_tokens": 50,
                                                     "response_format": schema})
    assert code == 200, reply
    message = reply["choices"][0]["message"]
    assert json.loads(message["content"]) == {"a": 1} and "reasoning_content" not in message


def test_json_schema_on_a_harmony_model_reasons_first_and_the_final_channel_is_the_answer(node: LocalNode) -> None:
    """gpt-oss's reply held to a schema may open an analysis message first (engines/constrained.py): the API reads
    its reasoning apart and the final channel's JSON is the content, streamed and not."""
    assert node.post("/models/add", {"model_id": HARMONY_MODEL})[0] == 200
    instance_id = place(node, HARMONY_MODEL)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 90, "the harmony instance to be ready", node.log_tail)
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    script = ('<|channel|>analysis<|message|>One it is.<|end|><|start|>assistant<|channel|>final<|message|>'
              '{"a": 1}')
    body = {"model": HARMONY_MODEL, "messages": ask(script), "max_tokens": 200, "response_format": schema}
    try:
        code, reply = node.post("/v1/chat/completions", body)
        assert code == 200, reply
        message = reply["choices"][0]["message"]
        assert json.loads(message["content"]) == {"a": 1} and message["reasoning_content"] == "One it is.", message
        deltas = [c["choices"][0]["delta"] for c in sse_data(node, "/v1/chat/completions", {**body, "stream": True})
                  if c.get("choices")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "One it is."
        assert json.loads("".join(d.get("content") or "" for d in deltas)) == {"a": 1}
    finally:
        with node.client() as client:
            assert client.delete(f"/instance/{instance_id}").status_code == 200


def test_anthropic_thinking_blocks(node: LocalNode) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=node.url, api_key="unused", timeout=60, max_retries=0)
    thinking: Any = {"type": "enabled", "budget_tokens": 1000}
    message = client.messages.create(model=MODEL, max_tokens=1200, thinking=thinking, messages=ask(THOUGHT))  # type: ignore[arg-type]
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == REASONING and message.content[1].text == ANSWER  # type: ignore[union-attr]
    with client.messages.stream(model=MODEL, max_tokens=1200, thinking=thinking, messages=ask(THOUGHT)) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    assert "".join(e.thinking for e in events if e.type == "thinking") == REASONING  # type: ignore[union-attr]
    assert "".join(e.text for e in events if e.type == "text") == ANSWER  # type: ignore[union-attr]
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER  # type: ignore[union-attr]
    follow = [*ask(THOUGHT), {"role": "assistant", "content": [b.model_dump() for b in final.content]},
              {"role": "user", "content": f"And? SKULK_SCRIPT<<<{THOUGHT}>>>"}]
    again = client.messages.create(model=MODEL, max_tokens=1200, thinking=thinking, messages=follow)  # type: ignore[arg-type]
    assert again.content[1].text == ANSWER  # type: ignore[union-attr]  # a thinking block sent back is accepted


def test_anthropic_budget_tokens_closes_the_reasoning_and_the_answer_follows(node: LocalNode) -> None:
    """The engine forces the close when the reasoning reaches the budget; the scripted model then answers. A token
    is a byte here: the open tag and the close take 17 of the 30, the reasoning is cut after some 13 characters."""
    body = {"model": MODEL, "max_tokens": 500, "thinking": {"type": "enabled", "budget_tokens": 30},
            "messages": ask(THOUGHT)}
    code, reply = node.post("/v1/messages", body)
    assert code == 200, reply
    assert [b["type"] for b in reply["content"]] == ["thinking", "text"] and reply["stop_reason"] == "end_turn", reply
    assert REASONING.startswith(reply["content"][0]["thinking"]) and reply["content"][0]["thinking"] != REASONING
    assert reply["content"][1]["text"] == ANSWER
    events = sse_data(node, "/v1/messages", {**body, "stream": True})
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"] and events[-2]["delta"]["stop_reason"] == "end_turn"
    texts = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and "text" in e["delta"]]
    assert "".join(texts) == ANSWER


def test_ollama_and_responses_budgets_close_the_reasoning_and_the_answer_follows(node: LocalNode) -> None:
    """Ollama's `options.reasoning_budget` (through the official client) and Responses' `reasoning.max_tokens`
    cap the reasoning as Claude's budget_tokens does: cut short, then the whole answer."""
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    reply = client.chat(model=MODEL, messages=ask(THOUGHT), think=True,
                        options={"num_predict": 500, "reasoning_budget": 30})  # type: ignore[arg-type]
    thinking = reply.message.thinking or ""
    assert REASONING.startswith(thinking) and thinking != REASONING and reply.message.content == ANSWER, reply
    code, answer = node.post("/v1/responses", {"model": MODEL, "input": ask(THOUGHT), "max_output_tokens": 500,
                                               "reasoning": {"max_tokens": 30}})
    assert code == 200, answer
    assert [item["type"] for item in answer["output"]] == ["reasoning", "message"], answer
    reasoning = answer["output"][0]["content"][0]["text"]
    assert REASONING.startswith(reasoning) and reasoning != REASONING
    assert answer["output"][1]["content"][0]["text"] == ANSWER
    assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] <= 30, answer["usage"]


def test_ollama_thinking(node: LocalNode) -> None:
    import ollama

    client = ollama.Client(host=f"{node.url}/ollama", timeout=60)
    reply = client.chat(model=MODEL, messages=ask(THOUGHT), think=True, options={"num_predict": 200})
    assert reply.message.thinking == REASONING and reply.message.content == ANSWER
    parts = list(client.chat(model=MODEL, messages=ask(THOUGHT), think=True, stream=True,
                             options={"num_predict": 200}))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content or "" for p in parts) == ANSWER
    generated = client.generate(model=MODEL, prompt=f"Hi! SKULK_SCRIPT<<<{THOUGHT}>>>", think=True,
                                options={"num_predict": 200})
    assert generated.thinking == REASONING and generated.response == ANSWER


def test_responses_reasoning_items(node: LocalNode) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=60, max_retries=0)
    reply = client.responses.create(model=MODEL, input=ask(THOUGHT), max_output_tokens=200,  # type: ignore[arg-type]
                                    reasoning={"effort": "low"})
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].text == REASONING and reply.output_text == ANSWER  # type: ignore[union-attr,index]
    assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens > 10
    events = list(client.responses.create(model=MODEL, input=ask(THOUGHT), max_output_tokens=200,  # type: ignore[arg-type]
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING  # type: ignore[union-attr]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    added = [e.output_index for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert added == [0, 1]


def test_pipeline_over_two_nodes_splits_on_the_sampling_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The last rank, which samples and publishes, did not render the prompt: it decides the split from the
    prompt's tail that the step header carried (engines/torch/wire.py's Admitted), and keeps a reasoning budget
    (chat's `reasoning_budget`, Claude's budget_tokens) by forcing the close there."""
    with thinking_model_served(tmp_path_factory.mktemp("reasoning-pipeline")) as cluster:
        first, _ = cluster.form(2)
        assert first.post("/models/add", {"model_id": MODEL})[0] == 200
        instance_id = place(first, MODEL, min_nodes=2, sharding="Pipeline")["instanceId"]
        wait_until(lambda: instance_ready(first, instance_id), 120, "the instance to be ready", first.log_tail)
        for script, extra in ((THOUGHT, {}), (OPENED, {"chat_template_kwargs": {"open_think": True}})):
            code, reply = first.post("/v1/chat/completions", {"model": MODEL, "messages": ask(script),
                                                              "max_tokens": 200, **extra})
            assert code == 200, reply
            message = reply["choices"][0]["message"]
            assert (message.get("reasoning_content"), message["content"]) == (REASONING, ANSWER), message
        capped = {"model": MODEL, "messages": ask(THOUGHT), "max_tokens": 200, "reasoning_budget": 30}
        code, reply = first.post("/v1/chat/completions", capped)  # the budget is kept on the sampling rank too
        assert code == 200, reply
        message = reply["choices"][0]["message"]
        assert message["content"] == ANSWER and REASONING.startswith(message["reasoning_content"]), message
        assert message["reasoning_content"] != REASONING
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 30, reply["usage"]
