"""Wait for every rank of an MLX ring with the GIL released, before mx.distributed forms it.

mx.distributed.init(backend="ring") holds the GIL while it waits for its neighbours (measured: a rank whose peer
came 10 s later heard nothing from its own heartbeat thread for those 10 s). The runner's heartbeat is a Python
thread, so a rank that reached init more than the supervisor's hung limit (15 s) before the slowest rank was
declared hung and killed, its instance restarted as a whole, and the same spread again on a loaded host: three
real nodes starting seven MLX ranks at once on 2 cores never got ready (tests/integration/
test_mlx_family_nodes.py). Here each rank first meets every other on the ring's own ports in plain Python sockets
(whose waits release the GIL): it listens on its port and says hello to every peer's; a peer acknowledges a hello
only once it has heard from all others and closed its listener, so a rank that has every acknowledgement knows
that all ranks are up and that no port of the ring is still held by this meeting. MLX's own connects then find
either nothing (and retry) or MLX itself, and init returns as soon as the ranks have crossed the few statements
between here and it.

The connecting side closes first, so the TIME_WAIT of each meeting's connection sits on its ephemeral port,
never on a port MLX binds next.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

HELLO = b"skulk-mlx-ring:"
ACK = b"k"
POLL_S = 0.05


class RendezvousError(RuntimeError):
    """A peer did not come in time, or something else answered on the ring's ports."""


def _address(host: str) -> tuple[str, int]:
    ip, _, port = host.rpartition(":")
    return ip.strip("[]"), int(port)


def meet(rank: int, hosts: Sequence[str], timeout_s: float) -> None:
    """Return once every rank of `hosts` has called meet (RendezvousError after timeout_s)."""
    peers = [p for p in range(len(hosts)) if p != rank]
    if not peers:
        return
    deadline = time.monotonic() + timeout_s
    listener = socket.create_server(_address(hosts[rank]), reuse_port=False, backlog=len(hosts))
    accepted: list[socket.socket] = []
    failure: list[BaseException] = []
    acked = threading.Event()
    acceptor = threading.Thread(target=_accept_all, args=(listener, len(peers), deadline, accepted, failure, acked),
                                name="mlx-rendezvous", daemon=True)
    acceptor.start()
    outgoing: list[socket.socket] = []
    try:
        for peer in peers:
            outgoing.append(_hello(hosts[peer], rank, deadline))
        for conn in outgoing:
            _expect_ack(conn, deadline)
        acked.wait(max(deadline - time.monotonic(), 0.0))
        if failure:
            raise failure[0]
        if not acked.is_set():
            raise RendezvousError(f"rank {rank}: not every peer of {list(hosts)} said hello in {timeout_s:.0f} s")
    finally:
        for conn in outgoing:  # the connecting side closes first (the module's docstring says why)
            conn.close()
        listener.close()
        acceptor.join(max(deadline - time.monotonic(), 1.0))  # the peers' closes end it
        for conn in accepted:
            conn.close()


def _hello(host: str, rank: int, deadline: float) -> socket.socket:
    """Connect to a peer's port (retrying while it is not listening yet) and say which rank this is."""
    while True:
        try:
            conn = socket.create_connection(_address(host), timeout=max(deadline - time.monotonic(), POLL_S))
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"rank {rank}: the ring's peer at {host} never listened ({exc})") from exc
            time.sleep(POLL_S)
            continue
        conn.sendall(HELLO + str(rank).encode() + b"\n")
        return conn


def _expect_ack(conn: socket.socket, deadline: float) -> None:
    conn.settimeout(max(deadline - time.monotonic(), POLL_S))
    try:
        got = conn.recv(1)
    except TimeoutError as exc:
        raise RendezvousError("a peer heard this rank but not all of the others in time") from exc
    if got != ACK:
        raise RendezvousError(f"a peer of the ring answered {got!r}, not the rendezvous' acknowledgement")


def _accept_all(listener: socket.socket, count: int, deadline: float, accepted: list[socket.socket],
                failure: list[BaseException], acked: threading.Event) -> None:
    """Thread: take `count` hellos (anything else that connects is dropped), close the listener, then
    acknowledge each (setting `acked`) and wait for each peer to close its side."""
    try:
        while len(accepted) < count:
            listener.settimeout(max(deadline - time.monotonic(), POLL_S))
            conn, _ = listener.accept()
            conn.settimeout(max(deadline - time.monotonic(), POLL_S))
            line = b""
            while not line.endswith(b"\n") and len(line) < 64:
                chunk = conn.recv(64)
                if not chunk:
                    break
                line += chunk
            if line.startswith(HELLO):
                accepted.append(conn)
            else:
                conn.close()
        listener.close()
        for conn in accepted:
            conn.sendall(ACK)
        acked.set()
        for conn in accepted:
            conn.recv(1)  # b"": the peer closed first
    except OSError as exc:  # socket.timeout included
        failure.append(RendezvousError(f"the ring's rendezvous failed: {exc!r}"))
