"""An attacker's view of real nodes on loopback, started with API keys: no key, a stranger's key, an inference
key on admin routes, someone else's cancel, a foreign Host or Origin, oversized and malformed bodies, and a
slowloris crowd of idle sockets. One two-node cluster serves the whole module."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zenoh

from skulk.cluster.intake import COMMANDS_KEY, ForwardedCommand
from skulk.cluster.seal import generate_key
from skulk.testing.convergence import master_of
from skulk.testing.nodes import LocalNode
from skulk.types.commands import DeleteInstance
from skulk.types.ids import CommandId, InstanceId, NodeId

from .harness import Cluster, place_and_wait

MODEL = "skulk/tiny-random-llama"
ADMIN, USER_A, USER_B = "admin-key-1", "user-key-a", "user-key-b"
CLUSTER_KEY = generate_key()
pytestmark = pytest.mark.timeout(240)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalNode]]:
    env = {"SKULK_API_KEYS": f"{USER_A},{USER_B}", "SKULK_ADMIN_KEYS": ADMIN, "SKULK_CLUSTER_KEY": CLUSTER_KEY}
    cluster = Cluster(tmp_path_factory.mktemp("security"), extra_env=env)
    try:
        started = cluster.form(2, headers=bearer(ADMIN))
        place_and_wait(started[0])
        yield started
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def chat(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}


def error_of(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]


def test_no_key_is_401_except_liveness(nodes: list[LocalNode]) -> None:
    node = nodes[1]
    for method, path in (("GET", "/state"), ("POST", "/v1/chat/completions"), ("GET", "/v1/diagnostics/node"),
                         ("POST", "/v1/cancel/anything"), ("DELETE", "/instance/x")):
        reply = httpx.request(method, node.url + path, json=chat(), timeout=10)
        assert reply.status_code == 401, (method, path, reply.text)
        assert error_of(reply)["code"] == "missing_api_key"
    wrong = httpx.get(node.url + "/state", headers=bearer("guess"), timeout=10)
    assert wrong.status_code == 401 and error_of(wrong)["code"] == "invalid_api_key"
    assert httpx.get(node.url + "/healthz", timeout=10).json() == {"status": "ok"}


def test_inference_key_chats_but_admin_routes_are_403(nodes: list[LocalNode]) -> None:
    node = nodes[1]
    ok = httpx.post(node.url + "/v1/chat/completions", json=chat(), headers={"x-api-key": USER_A}, timeout=60)
    assert ok.status_code == 200, ok.text
    for method, path, body in (("POST", "/place_instance", {"model_id": MODEL}), ("DELETE", "/instance/x", None),
                               ("GET", "/v1/diagnostics/node", None), ("POST", "/meta_instance", {"model_id": MODEL}),
                               ("POST", "/store/purge-staging", {})):
        reply = httpx.request(method, node.url + path, json=body, headers=bearer(USER_A), timeout=10)
        assert reply.status_code == 403, (method, path, reply.text)
        assert error_of(reply)["type"] == "permission_error"


def test_cluster_diagnostics_fan_out_with_the_internal_token(nodes: list[LocalNode]) -> None:
    """The fan-out to peers carries the cluster's internal token, not the caller's key: every peer answers."""
    reply = httpx.get(nodes[0].url + "/v1/diagnostics/cluster", headers=bearer(ADMIN), timeout=30)
    assert reply.status_code == 200, reply.text
    rows = reply.json()["nodes"]
    assert len(rows) == 2 and all(row["ok"] for row in rows), rows


def _open_stream(node: LocalNode, key: str) -> tuple[httpx.Client, Iterator[str], str]:
    """A streaming chat held open by `key`; returns its command id once the first token arrived. The line
    iterator is returned too: dropping it would close the connection, and the node would cancel the request."""
    client = httpx.Client(timeout=60, headers=bearer(key))
    # greedy: the demo model then writes all 1900 tokens (sampled, it ends on its own after 50-311 on this prompt,
    # which on the f32 kernel can be before the first cancel lands, in all five attempts under a loaded run)
    body = chat(1900, stream=True, temperature=0.0, messages=[{"role": "user", "content": "tell me a story"}])
    response = client.send(client.build_request("POST", node.url + "/v1/chat/completions", json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            return client, lines, json.loads(line[6:])["id"].removeprefix("chatcmpl-")
    raise AssertionError("the stream ended before its first chunk")


def test_only_the_key_that_started_a_request_may_cancel_it(nodes: list[LocalNode]) -> None:
    """User B may not cancel user A's stream; A may. (A random-weights model may end a stream early: then the
    cancel finds nothing (404) and the test opens another stream.)"""
    node = nodes[0]
    for _ in range(5):
        client, lines, command_id = _open_stream(node, USER_A)
        try:
            other = httpx.post(f"{node.url}/v1/cancel/{command_id}", headers=bearer(USER_B), timeout=10)
            if other.status_code == 404:
                continue
            assert other.status_code == 403, other.text
            assert "not started with this API key" in error_of(other)["message"]
            mine = httpx.post(f"{node.url}/v1/cancel/{command_id}", headers=bearer(USER_A), timeout=10)
            assert mine.status_code in (200, 404), mine.text  # 404: it ended by itself meanwhile
            return
        finally:
            del lines
            client.close()
    raise AssertionError("no stream stayed open long enough to be cancelled")


def test_foreign_host_and_origin_are_refused(nodes: list[LocalNode]) -> None:
    node = nodes[0]
    rebound = httpx.get(node.url + "/state", headers={**bearer(ADMIN), "Host": "evil.example:80"}, timeout=10)
    assert rebound.status_code == 400 and error_of(rebound)["code"] == "host_not_allowed"
    foreign = httpx.post(f"{node.url}/v1/cancel/x", headers={**bearer(ADMIN), "Origin": "https://evil.example"},
                         timeout=10)
    assert foreign.status_code == 403 and error_of(foreign)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in foreign.headers  # CORS is off by default
    same = httpx.post(f"{node.url}/v1/cancel/x", headers={**bearer(ADMIN), "Origin": node.url}, timeout=10)
    assert same.status_code == 404, same.text  # past the checks: there is simply no such request


def test_a_9_mib_body_is_refused_before_it_is_read(nodes: list[LocalNode]) -> None:
    """Content-Length says 9 MiB, 1 KiB is sent: the 413 arrives without waiting for the rest."""
    node = nodes[0]
    with socket.create_connection(("127.0.0.1", node.api_port), timeout=10) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {USER_A}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {9 * 1024 * 1024}\r\n\r\n")
        sock.sendall(head.encode() + b"{" + b" " * 1024)
        reply = b""
        while chunk := sock.recv(65536):  # the node closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert "8388608 bytes" in reply


def test_a_chunked_body_past_the_limit_is_cut_off_while_reading(nodes: list[LocalNode]) -> None:
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(9 * 16):  # 9 MiB in 64 KiB pieces, no Content-Length
            sent += 65536
            yield b" " * 65536

    try:
        reply = httpx.post(nodes[0].url + "/v1/chat/completions", content=body(), headers=bearer(USER_A),
                           timeout=30)
    except httpx.WriteError:
        return  # the node closed the connection while we still wrote: also refused while reading
    assert reply.status_code == 413, reply.text
    assert error_of(reply)["code"] == "request_too_large"


def test_malformed_requests_get_typed_errors(nodes: list[LocalNode]) -> None:
    url, headers = nodes[0].url, bearer(USER_A)
    surrogate = b'{"model":"%s","messages":[{"role":"user","content":"a\\ud800b"}]}' % MODEL.encode()
    reply = httpx.post(url + "/v1/chat/completions", content=surrogate, timeout=10,
                       headers={**headers, "Content-Type": "application/json"})
    assert reply.status_code == 400 and error_of(reply)["code"] == "invalid_unicode", reply.text
    cases = {
        "messages": chat(messages=[{"role": "user", "content": "x"}] * 2049),
        "name": chat(messages=[{"role": "user", "content": "x", "name": "n" * 300}]),
        "stop": chat(stop=["s" * 300]),
        "max_tokens": chat(max_tokens=10**9),
    }
    for field, body in cases.items():
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert reply.status_code == 422, (field, reply.text)
        assert field in error_of(reply)["message"], (field, reply.text)
    wrong_method = httpx.put(url + "/v1/chat/completions", json=chat(), headers=bearer(ADMIN), timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert error_of(wrong_method)["type"] == "invalid_request_error"

    as_json = {**headers, "Content-Type": "application/json"}
    deep = b'{"a":' * 5000 + b"1" + b"}" * 5000  # past the interpreter's recursion limit when parsed recursively
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                  "/v1/embeddings", "/ollama/api/chat", "/ollama/api/generate", "/ollama/api/show"):
        reply = httpx.post(url + route, content=deep, headers=as_json, timeout=10)
        assert reply.status_code == 400, (route, reply.text)
    for route in ("/v1/messages", "/ollama/api/show"):  # a field no length bound covers: it was echoed back
        reply = httpx.post(url + route, content=b'{"model": "a\\ud800b"}', headers=as_json, timeout=10)
        assert reply.status_code == 400 and "surrogate" in reply.text, (route, reply.text)
    count = {"messages": [{"role": "user", "content": "hi"}]}
    for model, status in (("..", 400), ("m" * 5000, 400)):  # never joined onto the models directory
        reply = httpx.post(url + "/v1/messages/count_tokens", json={**count, "model": model}, headers=headers,
                           timeout=10)
        assert reply.status_code == status and "model" in reply.text, (model[:9], reply.text)


def test_a_slowloris_crowd_does_not_stop_a_chat(nodes: list[LocalNode]) -> None:
    """1,100 sockets from another address (127.0.0.2) that never finish their request head; a real client still
    gets its answer. (From the client's own address the per-client cap would refuse it too, by design.)"""
    node = nodes[1]
    crowd: list[socket.socket] = []
    try:
        for _ in range(1100):
            try:
                sock = socket.create_connection(("127.0.0.1", node.api_port), timeout=10,
                                                source_address=("127.0.0.2", 0))
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            except OSError:
                continue  # closed on accept past the per-client cap: the crowd holds only its share
            crowd.append(sock)
        started = time.monotonic()
        reply = httpx.post(node.url + "/v1/chat/completions", json=chat(), headers=bearer(USER_B), timeout=60)
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started < 30
    finally:
        for sock in crowd:
            sock.close()


def test_prompts_never_reach_state_or_diagnostics(nodes: list[LocalNode]) -> None:
    """A system prompt sent through each node is answered (its payload went point to point to the runner's node)
    and never appears in /state or any diagnostics of any node, nor do other hosts' processes."""
    canary = "CANARY-7f3c-secret-system-prompt"
    for node in nodes:
        body = chat(messages=[{"role": "system", "content": canary}, {"role": "user", "content": "hi"}])
        reply = httpx.post(node.url + "/v1/chat/completions", json=body, headers=bearer(USER_A), timeout=60)
        assert reply.status_code == 200, reply.text
    for node in nodes:
        state = httpx.get(node.url + "/state", headers=bearer(ADMIN), timeout=10)
        tasks = state.json()["tasks"]
        assert tasks and all("taskParams" not in next(iter(t.values())) for t in tasks.values()), tasks
        for path in ("/state", "/v1/diagnostics/node", "/v1/diagnostics/cluster", "/v1/diagnostics/cluster/timeline"):
            text = httpx.get(node.url + path, headers=bearer(ADMIN), timeout=30).text
            assert canary not in text, path
        processes = httpx.get(node.url + "/v1/diagnostics/node", headers=bearer(ADMIN), timeout=30).json()
        assert all(p["isChildOfSkulk"] for p in processes["processes"]), processes["processes"]


def test_a_host_without_the_cluster_key_reads_nothing_and_is_not_believed(nodes: list[LocalNode]) -> None:
    """A plain zenoh peer on the cluster's endpoints: it hears only sealed bytes while a chat with a canary runs,
    the master's snapshot it asks for comes back sealed, and its forged DeleteInstance command, forged event and
    forged token chunk change nothing; the nodes count what they dropped."""
    canary = "CANARY-zenoh-eavesdropper"
    node = nodes[0]
    cluster = node.cluster
    heard: list[bytes] = []
    conf = zenoh.Config()
    conf.insert_json5("mode", json.dumps("peer"))
    conf.insert_json5("connect/endpoints", json.dumps([n.endpoint for n in nodes]))
    conf.insert_json5("scouting/multicast/enabled", "false")
    session = zenoh.open(conf)
    try:
        session.declare_subscriber(f"skulk/{cluster}/**", lambda sample: heard.append(sample.payload.to_bytes()))
        before = httpx.get(node.url + "/state", headers=bearer(ADMIN), timeout=10).json()
        instance_id = next(iter(before["instances"]))
        forged_delete = ForwardedCommand(origin=NodeId("attacker"), command=DeleteInstance(
            command_id=CommandId("forged-1"), instance_id=InstanceId(instance_id))).model_dump_json().encode()
        session.put(f"skulk/{cluster}/{COMMANDS_KEY}", forged_delete)
        session.put(f"skulk/{cluster}/events", b'{"idx": 999999, "event": {}}')
        client, lines, command_id = _open_stream(node, USER_A)
        try:
            session.put(f"skulk/{cluster}/data/{command_id}",
                        json.dumps({"TokenChunk": {"commandId": command_id, "text": "ATTACKER", "tokenId": 1,
                                                   "finishReason": "stop"}}).encode())
            text = "".join(line for line in lines)
        finally:
            client.close()
        assert "ATTACKER" not in text
        body = chat(messages=[{"role": "system", "content": canary}, {"role": "user", "content": "hi"}])
        assert httpx.post(nodes[1].url + "/v1/chat/completions", json=body, headers=bearer(USER_A),
                          timeout=60).status_code == 200
        master = master_of(node)
        snapshots = [r.ok.payload.to_bytes() for r in session.get(f"skulk/{cluster}/master/{master}/snapshot",
                                                                  timeout=5) if r.ok is not None]
        assert snapshots and all(s.startswith(b"S1") and canary.encode() not in s for s in snapshots)
    finally:
        session.close()
    theirs = [payload for payload in heard if not payload.startswith(b"{")]  # ours come back to us too
    assert theirs and all(payload.startswith(b"S1") for payload in theirs)
    assert not any(canary.encode() in payload for payload in heard)
    after = httpx.get(node.url + "/state", headers=bearer(ADMIN), timeout=10).json()
    assert instance_id in after["instances"], "a forged DeleteInstance deleted the instance"
    dropped = [httpx.get(n.url + "/v1/diagnostics/security", headers=bearer(ADMIN), timeout=10).json()
               for n in nodes]
    assert all(d["sealed"] for d in dropped) and sum(d["forgedDropped"] for d in dropped) >= 3, dropped
