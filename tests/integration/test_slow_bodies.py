"""A key holder who drips request bodies cannot hold the API (issue 27): a body that keeps dripping is refused
(408) at its deadline, not only one that stalls, and one client address gets only its own share of the
connections, so the same flood from 127.0.0.2 leaves a chat from 127.0.0.1 served."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, place_and_wait

KEY = "slow-body-key"
ADMIN = "slow-body-admin"
MODEL = "skulk/tiny-random-llama"
MAX_CONNECTIONS = 120
PER_CLIENT = 40
REQUEST_TIMEOUT_S = 4.0
pytestmark = pytest.mark.timeout(240)


def _head(node: LocalNode, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _dripper(node: LocalNode, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", node.api_port))
    sock.sendall(_head(node, 100_000) + b"{")
    return sock


@contextmanager
def flood(node: LocalNode, count: int, source: str = "127.0.0.2") -> Iterator[list[socket.socket]]:
    """`count` connections from `source`, each with a valid key and a body dripping a byte a second."""
    crowd: list[socket.socket] = []
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(1.0):
            for sock in list(crowd):
                try:
                    sock.send(b" ")
                except OSError:
                    crowd.remove(sock)

    for _ in range(count):
        try:
            crowd.append(_dripper(node, source))
        except OSError:
            break  # refused or reset on accept: the cap at work
    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    try:
        yield crowd
    finally:
        stop.set()
        dripping.join()
        for sock in crowd:
            sock.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    env = {"SKULK_API_KEYS": KEY, "SKULK_ADMIN_KEYS": ADMIN, "SKULK_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
           "SKULK_MAX_CONNECTIONS_PER_CLIENT": str(PER_CLIENT), "SKULK_REQUEST_TIMEOUT_SECONDS": str(REQUEST_TIMEOUT_S),
           "SKULK_BODY_TIMEOUT_SECONDS": "3"}
    cluster = Cluster(tmp_path_factory.mktemp("slow"), extra_env=env)
    try:
        started = cluster.form(1, headers={"Authorization": f"Bearer {ADMIN}"})[0]  # formed: its memory is known
        place_and_wait(started)
        yield started
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def test_a_dripping_body_is_refused_at_its_deadline(node: LocalNode) -> None:
    sock = _dripper(node, "127.0.0.1")
    started = time.monotonic()
    reply = b""
    try:
        sock.settimeout(1.0)
        while not reply and time.monotonic() - started < 20:
            try:
                reply = sock.recv(4096)
            except TimeoutError:
                sock.send(b" ")  # a byte a second: never a stall
        took = time.monotonic() - started
        while reply and b"not complete within" not in reply:  # the body may come in a later segment
            more = sock.recv(4096)  # the answer says connection: close, so this ends at EOF
            if not more:
                break
            reply += more
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), (took, reply[:200])
    assert b"not complete within" in reply
    assert took < REQUEST_TIMEOUT_S + 3.0, took


def test_a_flood_from_one_address_leaves_the_api_serving_others(node: LocalNode) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with flood(node, MAX_CONNECTIONS + 10):
        reply = httpx.post(node.url + "/v1/chat/completions", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {KEY}"})
        assert reply.status_code == 200, reply.text
