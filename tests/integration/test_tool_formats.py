"""Tool calls in a family's own format through a real node: a Mistral checkpoint (random weights, Mistral's
tool template with its nine-character id check) added from a local fake of the hub, its replies scripted
(SKULK_FAULT=script:reply) because a random model never writes a call; and a checkpoint whose template writes
Kimi K2's call tokens, read by the parser that template picks. The Qwen/Hermes format is covered through every
client SDK in test_clients.py; every format's text, streamed and not, in tests/unit/test_tool_formats_api.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fake_hub import MISTRAL_TEMPLATE, RunningHub, set_chat_template, write_random_model

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL = "org/tiny-mistral"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def _mistral_repo(root: Path) -> None:
    repo = write_random_model(root, MODEL)
    config = json.loads((repo / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (repo / "config.json").write_text(json.dumps(config))
    set_chat_template(repo, MISTRAL_TEMPLATE)


def test_mistral_tool_calls_round_trip_from_openai_and_ollama_clients(cluster: Cluster, tmp_path: Path) -> None:
    """The list after [TOOL_CALLS] becomes tool_calls; the call sent back, under our id or another provider's
    (OpenAI) or none (Ollama), passes the template's id check and the conversation goes on."""
    _mistral_repo(tmp_path / "hub")
    hub = RunningHub(tmp_path / "hub").start()
    try:
        node = cluster.start(1, extra_env={"HF_ENDPOINT": hub.url, "SKULK_FAULT": "script:reply"})[0]
        assert node.post("/models/add", {"model_id": MODEL})[0] == 200
        instance_id = place(node, MODEL)["instanceId"]
        wait_until(lambda: instance_ready(node, instance_id), 90, "the instance to be ready", node.log_tail)

        ask: list[dict[str, Any]] = [{"role": "user", "content": f"Weather in Paris? SKULK_SCRIPT<<<{MISTRAL_CALL}>>>"}]
        code, reply = node.post("/v1/chat/completions", {"model": MODEL, "messages": ask, "tools": WEATHER,
                                                         "max_tokens": 200})
        assert code == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}

        body = {"model": MODEL, "messages": ask, "tools": WEATHER, "max_tokens": 200, "stream": True}
        with node.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as reply:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in reply.iter_lines()
                      if line.startswith("data: {") and '"choices":[{' in line]
        assert not "".join(d.get("content") or "" for d in deltas), deltas  # the call's text never streams
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["get_weather"]

        for call_id in (call["id"], "call_Zq9xV3kLmN8pR2sT"):  # ours, then an id another provider gave
            follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [{**call, "id": call_id}]},
                      {"role": "tool", "tool_call_id": call_id, "content": "sunny SKULK_SCRIPT<<<It is sunny.>>>"}]
            code, answer = node.post("/v1/chat/completions", {"model": MODEL, "messages": follow, "tools": WEATHER,
                                                              "max_tokens": 50})
            assert code == 200, answer
            assert answer["choices"][0]["message"]["content"] == "It is sunny.", answer

        ollama = {"model": MODEL, "tools": WEATHER, "stream": False, "options": {"num_predict": 200}}
        code, reply = node.post("/ollama/api/chat", {**ollama, "messages": ask})
        assert code == 200, reply
        assert [c["function"]["name"] for c in reply["message"]["tool_calls"]] == ["get_weather"], reply
        follow = [*ask, reply["message"], {"role": "tool", "content": "sunny SKULK_SCRIPT<<<Sunny.>>>"}]
        code, answer = node.post("/ollama/api/chat", {**ollama, "messages": follow})
        assert code == 200, answer
        assert answer["message"]["content"] == "Sunny.", answer
    finally:
        hub.kill()


KIMI_MODEL = "org/tiny-kimi"
KIMI_TEMPLATE = (  # ChatML with Kimi K2's call tokens in its tools section: the API picks the Kimi parser from it
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    "Call as <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>JSON"
    "<|tool_call_end|><|tool_calls_section_end|><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
DAYS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
KIMI_CALL = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
             '<|tool_call_argument_begin|>{"city": "Paris", "days": "3"}<|tool_call_end|><|tool_calls_section_end|>')


def test_a_kimi_template_gets_kimi_calls_with_typed_arguments(cluster: Cluster, tmp_path: Path) -> None:
    """The template on the node says which parser reads the reply (the family, llama, would read bare JSON):
    the call in Kimi K2's tokens becomes tool_calls with `days` an integer as the tool's schema has it, streamed
    and not. The byte-level test vocabulary splits each token's text across several tokens."""
    repo = write_random_model(tmp_path / "hub", KIMI_MODEL)
    set_chat_template(repo, KIMI_TEMPLATE)
    hub = RunningHub(tmp_path / "hub").start()
    try:
        node = cluster.start(1, extra_env={"HF_ENDPOINT": hub.url, "SKULK_FAULT": "script:reply"})[0]
        assert node.post("/models/add", {"model_id": KIMI_MODEL})[0] == 200
        instance_id = place(node, KIMI_MODEL)["instanceId"]
        wait_until(lambda: instance_ready(node, instance_id), 90, "the instance to be ready", node.log_tail)
        ask = [{"role": "user", "content": f"Weather? SKULK_SCRIPT<<<{KIMI_CALL}>>>"}]
        body = {"model": KIMI_MODEL, "messages": ask, "tools": DAYS, "max_tokens": 300}
        code, reply = node.post("/v1/chat/completions", body)
        assert code == 200, reply
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking.", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}
        with node.client() as client, client.stream("POST", "/v1/chat/completions",
                                                    json={**body, "stream": True}) as streamed:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.iter_lines()
                      if line.startswith("data: {") and '"choices":[{' in line]
        assert "".join(d.get("content") or "" for d in deltas).strip() == "Checking.", deltas
        calls = [c["function"] for d in deltas for c in d.get("tool_calls") or []]
        assert calls == [call["function"]]
    finally:
        hub.kill()
