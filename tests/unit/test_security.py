"""The API's guards as pure decisions and on an in-process app: scopes per route, keys, Host names, the body
limit while reading, typed 405/413/500, field limits, and the rate limit on logging."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from skulk.api.config_routes import effective
from skulk.api.errors import install_error_handlers
from skulk.api.security import Access, KeyRing, LocalNames, host_name_of, install_security, required_access
from skulk.config import Settings
from skulk.logs import RateLimitFilter
from skulk.types.chat import ChatCompletionRequest, ChatMessage, SamplingParams
from skulk.types.commands import StartChatCompletion
from skulk.types.events import TaskCreated
from skulk.types.ids import CommandId
from skulk.types.limits import INVALID_UNICODE
from skulk.types.tasks import ChatCompletionTaskParams

from .factories import CARD, applied, chat_task


@pytest.mark.parametrize(("method", "path", "access"), [
    ("GET", "/healthz", Access.NONE),
    ("GET", "/node_id", Access.NONE),
    ("POST", "/v1/chat/completions", Access.INFERENCE),
    ("GET", "/v1/models/skulk/tiny-random-llama", Access.INFERENCE),
    ("POST", "/v1/cancel/abc", Access.INFERENCE),
    ("POST", "/v1/messages", Access.INFERENCE),
    ("POST", "/api/chat", Access.INFERENCE),
    ("POST", "/v1/responses", Access.INFERENCE),
    ("GET", "/v1/responses/resp_abc", Access.INFERENCE),
    ("DELETE", "/v1/responses/resp_abc", Access.INFERENCE),
    ("POST", "/ollama/api/embeddings", Access.INFERENCE),
    ("POST", "/ollama/api/pull", Access.ADMIN),
    ("POST", "/admin/restart", Access.ADMIN),
    ("PUT", "/v1/tracing", Access.ADMIN),
    ("GET", "/state", Access.INFERENCE),
    ("HEAD", "/state", Access.INFERENCE),
    ("POST", "/place_instance", Access.ADMIN),
    ("DELETE", "/instance/abc", Access.ADMIN),
    ("GET", "/v1/diagnostics/node", Access.ADMIN),
    ("POST", "/store/purge-staging", Access.ADMIN),
    ("PUT", "/config", Access.ADMIN),
    ("GET", "/some/route/added/later", Access.ADMIN),
])
def test_every_route_needs_admin_unless_listed(method: str, path: str, access: Access) -> None:
    assert required_access(method, path) is access


def test_keys_have_scopes() -> None:
    ring = KeyRing(inference=("u",), admin=("a",))
    assert (ring.access_of("u"), ring.access_of("a"), ring.access_of("x"), ring.access_of(None)) == (
        Access.INFERENCE, Access.ADMIN, Access.NONE, Access.NONE)
    assert not KeyRing().enabled


def test_host_names() -> None:
    assert [host_name_of(h) for h in ("a.lan:52415", "[::1]:80", "10.0.0.2", "::1")] == ["a.lan", "::1",
                                                                                          "10.0.0.2", "::1"]
    names = LocalNames(frozenset({"gpu-box.example"}))
    assert names.allows("localhost") and names.allows("127.0.0.1") and names.allows("GPU-box.example")
    assert not names.allows("evil.example")
    assert LocalNames(frozenset({"*"})).allows("evil.example")


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)
    install_security(app, Settings(api_keys=["u"], admin_keys=["a"], max_body_bytes=1024))

    @app.post("/v1/chat/completions")
    async def echo(request: Request) -> dict[str, Any]:
        return {"size": len(await request.body())}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_body_limit_while_reading_and_typed_errors(client: TestClient) -> None:
    user = {"Authorization": "Bearer u"}
    assert client.post("/v1/chat/completions", content=b"x" * 1024, headers=user).json() == {"size": 1024}
    declared = client.post("/v1/chat/completions", content=b"x" * 2048, headers=user)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    assert "1024 bytes" in declared.json()["error"]["message"]
    chunked = client.post("/v1/chat/completions", content=iter([b"x" * 600, b"x" * 600]), headers=user)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    crash = client.get("/boom", headers={"x-api-key": "a"})
    assert crash.status_code == 500 and crash.json()["error"]["code"] == "internal_error"
    wrong = client.get("/v1/chat/completions", headers={"x-api-key": "a"})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and "error" in wrong.json()
    assert client.get("/healthz").json() == {"status": "ok"}


def _request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(("field", "body"), [
    ("messages", _request(messages=[{"role": "user", "content": "x"}] * 2049)),
    ("content", _request(messages=[{"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}])),
    ("name", _request(messages=[{"role": "user", "content": "x", "name": "n" * 257}])),
    ("stop", _request(stop=["s" * 257])),
    ("max_tokens", _request(max_tokens=2**20 + 1)),
    ("model", _request(model="m" * 257)),
])
def test_field_limits_name_the_field(field: str, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(body)
    assert any(field in ".".join(str(p) for p in err["loc"]) for err in caught.value.errors()), caught.value


def test_a_lone_surrogate_is_invalid_unicode() -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate(_request(messages=[{"role": "user", "content": "a\ud800"}]))
    assert INVALID_UNICODE in {err["type"] for err in caught.value.errors()}


def test_log_flood_is_cut_and_counted() -> None:
    now = [0.0]
    limiter = RateLimitFilter(burst=3, total=100, window_s=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    passed = [limiter.filter(record("accept failed")) for _ in range(10)]
    assert passed == [True] * 3 + [False] * 7
    assert limiter.filter(record("something else"))
    now[0] = 11.0
    later = record("accept failed")
    assert limiter.filter(later) and later.msg.startswith("[7 similar messages suppressed]")


def test_a_prompt_never_serialises_with_its_task() -> None:
    """The payload a worker attaches for its runner is excluded from every dump: no event, snapshot or /state
    can carry it, even if a task with one reached the state by mistake."""
    params = ChatCompletionTaskParams(model=CARD.model_id, messages=[ChatMessage(role="user", content="SECRET")],
                                      sampling=SamplingParams())
    task = chat_task().model_copy(update={"task_params": params})
    assert task.task_params is params
    state = applied(TaskCreated(task=task))
    for dumped in (task.model_dump_json(), TaskCreated(task=task).model_dump_json(), state.model_dump_json()):
        assert "SECRET" not in dumped and "messages" not in dumped
    command = StartChatCompletion(command_id=CommandId("c"), model=CARD.model_id).model_dump(by_alias=True)
    assert set(command["StartChatCompletion"]) == {"commandId", "model", "originNodeId", "instanceId"}


def test_config_route_never_shows_keys() -> None:
    shown = effective(Settings(api_keys=["u"], admin_keys=["a"], cluster_key="k", hf_token="hf"))
    text = repr(shown)
    assert "'u'" not in text and "'a'" not in text and "'k'" not in text and "'hf'" not in text
    assert shown["has_cluster_key"] and shown["api_key_count"] == 1 and shown["admin_key_count"] == 1


def test_an_error_echoing_a_lone_surrogate_still_encodes() -> None:
    """A message quoting what the client sent (a model name) may hold text no UTF-8 encoder takes; rendering the
    error then failed and the client saw its connection reset instead of the 4xx."""
    from skulk.api.errors import ApiError, ErrorCode

    error = ApiError(ErrorCode.model_not_found, "model 'a\ud800' not found")
    assert error.message.encode("utf-8") == b"model 'a\\ud800' not found"


def test_the_node_app_refuses_keyless_requests_on_a_keyed_node(tmp_path: Any) -> None:
    """create_app itself, not an app assembled here: removing install_security from it fails this test."""
    from skulk.api.app import create_app

    from .factories import api_services

    settings = Settings(config=tmp_path / "skulk.yaml", home=tmp_path, api_keys=["u"], admin_keys=["a"])
    app = create_app(api_services(settings=settings, home=tmp_path))
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        assert client.get("/healthz").status_code == 200
        for path in ("/state", "/v1/models", "/v1/diagnostics/node", "/config"):
            refused = client.get(path)
            assert refused.status_code == 401, (path, refused.status_code, refused.text[:200])
            assert client.get(path, headers={"Authorization": "Bearer a"}).status_code == 200, path
        assert client.get("/v1/diagnostics/node", headers={"Authorization": "Bearer u"}).status_code == 403
