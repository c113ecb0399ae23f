"""The API's connection caps count only the connections they admitted (issue 27's slow-body flood).

A burst that the server accepts in one turn of its loop (a flood from one address with a legitimate client
among it) must leave the legitimate client served: connections refused by the per-client cap are not yet
gone from uvicorn's own `connections` set in that turn, so a global cap read from that set refused the
legitimate client too (seen as a reset chat in a full run of test_slow_bodies on a loaded machine)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from skulk.api.limits import guarded_protocol

pytestmark = pytest.mark.timeout(60)
GLOBAL_CAP = 20
PER_CLIENT = 5


def _app(entered: threading.Event, release: threading.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/block")
    async def block() -> dict[str, str]:  # blocks the server's loop on purpose: the burst queues in the backlog
        entered.set()
        release.wait(30)
        return {"ok": "blocked"}

    @app.get("/ok")
    async def ok() -> dict[str, str]:
        return {"ok": "yes"}

    return app


HEAD_TIMEOUT_S = 1.0


@pytest.fixture(params=[True, False], ids=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, threading.Event, threading.Event]]:
    """The guard on either of uvicorn's parsers: httptools (the node's), h11 (where httptools has no wheel)."""
    entered, release = threading.Event(), threading.Event()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol = guarded_protocol(GLOBAL_CAP, HEAD_TIMEOUT_S, PER_CLIENT, c_parser=request.param)
    assert ("HttpTools" in protocol.__name__) == request.param
    config = uvicorn.Config(_app(entered, release), log_level="warning", lifespan="off", backlog=512, http=protocol)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not srv.started:
            threading.Event().wait(0.01)
        yield sock.getsockname()[1], entered, release
    finally:
        release.set()
        srv.should_exit = True
        thread.join(10)


def _get(port: int, path: str, source: str = "127.0.0.1") -> socket.socket:
    conn = socket.socket()
    conn.bind((source, 0))
    conn.settimeout(20)
    conn.connect(("127.0.0.1", port))
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return conn


def test_a_burst_from_one_address_does_not_refuse_another_accepted_in_the_same_turn(
    server: tuple[int, threading.Event, threading.Event],
) -> None:
    port, entered, release = server
    blocker = _get(port, "/block")
    assert entered.wait(20), "the blocking request never reached the app"
    flood = []
    for _ in range(GLOBAL_CAP * 2):  # all wait in the kernel's backlog while the loop is blocked
        conn = socket.socket()
        conn.bind(("127.0.0.2", 0))
        conn.connect(("127.0.0.1", port))
        flood.append(conn)
    legit = _get(port, "/ok")
    release.set()
    try:
        reply = legit.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        for conn in [blocker, legit, *flood]:
            conn.close()


def test_a_connection_that_sends_no_head_is_closed_and_a_whole_head_is_answered(
    server: tuple[int, threading.Event, threading.Event],
) -> None:
    """The head deadline: a socket that sends half a request line and then nothing is aborted once the deadline
    passes (its read ends, where without the guard it would block until this test's own timeout); a request whose
    head came in time is answered."""
    port, _, _ = server
    silent = socket.socket()
    silent.settimeout(20 * HEAD_TIMEOUT_S)
    silent.connect(("127.0.0.1", port))
    silent.sendall(b"GET /ok HT")
    answered = _get(port, "/ok")
    try:
        assert answered.recv(4096).startswith(b"HTTP/1.1 200")
        try:
            assert silent.recv(4096) == b""
        except ConnectionResetError:  # an abort may reset rather than close
            pass
    finally:
        silent.close()
        answered.close()
