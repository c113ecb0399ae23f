"""A bad request fails alone: sampling bounds at the API (422 naming the field and its range), and an exception
inside the engine for one request ends that request only, its batch-mates unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skulk.api.errors import install_error_handlers
from skulk.api.openai import openai_router
from skulk.engines.base import TokenOut
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import ensure_demo_model
from skulk.runner.fault import CrashFault, InjectedFault, PoisonHook, RaiseFault, parse_fault
from skulk.types.chat import SamplingParams

from .factories import api_services

pytestmark = pytest.mark.timeout(120)

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def api() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(openai_router(api_services()))  # validation answers before the node is asked anything
    return TestClient(app)


@pytest.mark.parametrize(
    ("field", "value", "range_text"),
    [
        ("seed", 2**64, "0...18446744073709551615"),
        ("seed", -1, "0...18446744073709551615"),
        ("top_k", 2**63, "0...2147483647"),
        ("top_k", -1, "0...2147483647"),
        ("temperature", 2.5, "0...2"),
        ("temperature", -0.1, "0...2"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("max_tokens", 0, ">= 1"),
        ("max_completion_tokens", 0, ">= 1"),
    ],
)
def test_out_of_range_sampling_fields_are_422_naming_field_and_range(
    api: TestClient, field: str, value: Any, range_text: str
) -> None:
    reply = api.post("/v1/chat/completions", json={**GOOD, field: value})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["message"].startswith(f"{field}: ") and range_text in error["message"], error["message"]


def test_non_finite_temperature_is_422(api: TestClient) -> None:
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    reply = api.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 422 and "temperature" in reply.json()["error"]["message"]


def test_bounds_hold_for_engine_sampling_params_too() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert SamplingParams(seed=2**64 - 1, top_k=2**31 - 1).seed == 2**64 - 1


# --- the engine ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def run(engine: TorchEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list[TokenOut]]:
    for rid, (text, sampling) in requests.items():
        engine.add_request(rid, engine.tokenizer.encode(text), sampling)
    outs: dict[str, list[TokenOut]] = {rid: [] for rid in requests}
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


GREEDY = SamplingParams(max_tokens=10, temperature=0)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_k=2**31 - 1, top_p=0.95, seed=2**64 - 1)


@pytest.mark.parametrize("where", ["sample", "detokenize"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_raising_request_fails_alone_and_its_batch_mate_is_unchanged(
    demo_dir: Path, where: str, sampling: SamplingParams
) -> None:
    alone = run(TorchEngine(demo_dir, max_seq=128), {"good": ("hello there", sampling)})["good"]
    engine = TorchEngine(demo_dir, max_seq=128)
    engine.fault_hook = PoisonHook(RaiseFault(where), 0, engine.tokenizer.decode)  # type: ignore[arg-type]
    outs = run(engine, {"bad": ("SKULK_POISON now", sampling), "good": ("hello there", sampling)})
    assert len(outs["bad"]) == 1 and outs["bad"][0].error is not None
    assert "InjectedFault" in outs["bad"][0].error
    assert [(o.token_id, o.text, o.finish_reason) for o in outs["good"]] == [
        (o.token_id, o.text, o.finish_reason) for o in alone
    ]
    assert all(o.error is None for o in outs["good"]) and not engine.has_work()
    assert run(engine, {"again": ("hello there", sampling)})["again"][-1].finish_reason is not None


def test_a_raising_admission_raises_to_the_runner_and_leaves_the_engine_clean(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=128)
    engine.fault_hook = PoisonHook(RaiseFault("admit"), 0, engine.tokenizer.decode)
    with pytest.raises(InjectedFault):
        engine.add_request("bad", engine.tokenizer.encode("SKULK_POISON"), GREEDY)
    assert not engine.has_work()


def test_fault_kinds_parse_and_only_poisoned_requests_trip() -> None:
    assert parse_fault("raise:sample:rank=1") == RaiseFault("sample", rank=1)
    assert parse_fault("crash:poison") == CrashFault()
    hook = PoisonHook(RaiseFault("sample", rank=1), 0, lambda ids: "SKULK_POISON")
    hook("sample", type("R", (), {"request_id": "r", "prompt": [1]})())  # rank 0: not this rank's fault


def test_crash_fault_exits_the_process_on_a_poisoned_request(monkeypatch: pytest.MonkeyPatch) -> None:
    import skulk.runner.fault as fault

    exits: list[int] = []
    monkeypatch.setattr(fault.os, "_exit", exits.append)
    hook = PoisonHook(CrashFault(), 0, lambda ids: "SKULK_POISON" if ids == [1] else "fine")
    hook("admit", type("R", (), {"request_id": "ok", "prompt": [2]})())
    assert exits == []
    hook("sample", type("R", (), {"request_id": "bad", "prompt": [1]})())
    assert exits == [fault.CRASH_EXIT_CODE]


def test_top_k_above_the_models_vocabulary_is_422_naming_the_vocabulary() -> None:

    from skulk.types.events import InstanceCreated
    from skulk.types.ids import ModelId

    from .factories import applied, instance

    demo = instance().model_copy(
        update={
            "shard_assignments": instance().shard_assignments.model_copy(
                update={"model_id": ModelId("skulk/tiny-random-llama")}
            )
        }
    )
    node = api_services(applied(InstanceCreated(instance=demo)))
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(openai_router(node))
    body = {**GOOD, "model": "skulk/tiny-random-llama", "top_k": 261}
    reply = TestClient(app).post("/v1/chat/completions", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["message"].startswith("top_k: ") and "0...260" in reply.text


def test_a_template_that_refuses_the_messages_is_a_prompt_rejected_with_its_message(
    demo_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from skulk.engines.errors import PromptRejected
    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.types.chat import ChatMessage
    from tests.fake_hub import ALTERNATING_TEMPLATE, set_chat_template

    strict = tmp_path / "strict"
    shutil.copytree(demo_dir, strict)
    set_chat_template(strict, ALTERNATING_TEMPLATE)
    tokenizer = ChatTokenizer(strict)
    user = ChatMessage(role="user", content="hi")
    assert tokenizer.encode_chat([user])  # an alternating conversation renders
    with pytest.raises(PromptRejected, match="rejected the messages: Conversation roles must alternate"):
        tokenizer.encode_chat([user, user])
    set_chat_template(strict, "{% for message in messages %}")  # broken: the model's fault, not the client's
    with pytest.raises(Exception) as raised:
        ChatTokenizer(strict).encode_chat([user])
    assert not isinstance(raised.value, PromptRejected)


def test_tool_call_ids_reach_a_mistral_template_as_nine_alphanumerics(demo_dir: Path, tmp_path: Path) -> None:
    """Mistral's template refuses any call id but nine alphanumerics; clients send ours (`call_…`), Claude's
    `toolu_…`, or none at all (Ollama): each renders, a call and its result under the same id."""
    import shutil

    from skulk.engines.torch.tokenizer import ChatTokenizer, template_call_id, template_messages
    from skulk.types.chat import ChatMessage, FunctionCall, ToolCall
    from tests.fake_hub import MISTRAL_TEMPLATE, set_chat_template

    mistral = tmp_path / "mistral"
    shutil.copytree(demo_dir, mistral)
    set_chat_template(mistral, MISTRAL_TEMPLATE)
    calls = [ToolCall(id=i, function=FunctionCall(name="f", arguments='{"x": 1}')) for i in ("call_7_0", "toolu_01AbC")]
    history = [
        ChatMessage(role="user", content="go"),
        ChatMessage(role="assistant", tool_calls=calls),
        ChatMessage(role="tool", content="one", tool_call_id="call_7_0"),
        ChatMessage(role="tool", content="two"),  # Ollama: no id, answers the call still open
        ChatMessage(role="user", content="and?"),
    ]
    rendered = template_messages(history)
    ids = [c["id"] for c in rendered[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [rendered[2]["tool_call_id"], rendered[3]["tool_call_id"]] == ids
    assert template_call_id("abcDEF123") == "abcDEF123"  # already the shape: kept
    assert ChatTokenizer(mistral).encode_chat(history, [{"type": "function", "function": {"name": "f"}}])
