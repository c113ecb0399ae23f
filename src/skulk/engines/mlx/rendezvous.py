"""Wait for every rank of an MLX ring with the GIL released, before mx.distributed forms it.

mx.distributed.init(backend="ring") holds the GIL while it waits for its neighbours (measured: a rank whose peer
came 10 s later heard nothing from its own heartbeat thread for those 10 s). The runner's heartbeat is a Python
thread, so a rank that reached init more than the supervisor's hung limit (15 s) before the slowest rank was
declared hung and killed, its instance restarted as a whole, and the same spread again on a loaded host: three
real nodes starting seven MLX ranks at once on 2 cores never got ready (tests/integration/
test_mlx_family_nodes.py).

So the ranks first meet on the ring's own addresses in plain Python sockets, whose waits release the GIL, and
only as the ring does (a rank reaches its successor at the successor's address; on point-to-point links that may
be the only peer it can reach): each listens on its address, connects to its successor's and takes its
predecessor's connection, then closes its listener. Rank 0 sends "up" around the ring; once it comes back every
rank is up and every listener closed, and rank 0 sends "go" around, each rank passing it on and then calling
init. MLX's own connects then find either nothing yet (and retry) or MLX itself, and init returns at once.
The connecting side closes first, so each meeting connection's TIME_WAIT sits on an ephemeral port, never on
a port MLX binds next.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

HELLO = b"skulk-mlx-ring\n"
UP, GO = b"u", b"g"
POLL_S = 0.05


class RendezvousError(RuntimeError):
    """A neighbour did not come in time, or something else answered on the ring's addresses."""


def _address(host: str) -> tuple[str, int]:
    ip, _, port = host.rpartition(":")
    return ip.strip("[]"), int(port)


def meet(rank: int, hosts: Sequence[str], timeout_s: float) -> None:
    """Return once every rank of `hosts` has called meet (RendezvousError after timeout_s)."""
    size = len(hosts)
    if size < 2:
        return
    deadline = time.monotonic() + timeout_s
    listener = socket.create_server(_address(hosts[rank]), backlog=size)
    successor: socket.socket | None = None
    predecessor: socket.socket | None = None
    try:
        successor = _connect(hosts[(rank + 1) % size], deadline)
        predecessor = _accept(listener, deadline)
        listener.close()
        for token in (UP, GO):
            if rank == 0:
                successor.sendall(token)
                _expect(predecessor, token, deadline)
            else:
                _expect(predecessor, token, deadline)
                successor.sendall(token)
        successor.close()  # the connecting side closes first (the module's docstring says why)
        successor = None
        _expect(predecessor, b"", deadline)  # the predecessor has passed "go" on and closed its side
    except (OSError, RendezvousError) as exc:
        raise RendezvousError(f"rank {rank} of the ring {list(hosts)}: {exc}") from exc
    finally:
        for sock in (successor, predecessor, listener):
            if sock is not None:
                sock.close()


def _connect(host: str, deadline: float) -> socket.socket:
    """Connect to the successor's address (retrying while it is not listening yet) and say hello."""
    while True:
        try:
            conn = socket.create_connection(_address(host), timeout=_left(deadline))
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(f"the next rank at {host} never listened ({exc})") from exc
            time.sleep(POLL_S)
            continue
        conn.sendall(HELLO)
        return conn


def _accept(listener: socket.socket, deadline: float) -> socket.socket:
    """The predecessor's connection: the first that says hello (anything else that connects is dropped)."""
    while True:
        listener.settimeout(_left(deadline))
        try:
            conn, _ = listener.accept()
        except TimeoutError as exc:
            raise RendezvousError("the previous rank never connected") from exc
        conn.settimeout(_left(deadline))
        got = b""
        while len(got) < len(HELLO):
            chunk = conn.recv(len(HELLO) - len(got))
            if not chunk:
                break
            got += chunk
        if got == HELLO:
            return conn
        conn.close()


def _expect(conn: socket.socket, token: bytes, deadline: float) -> None:
    conn.settimeout(_left(deadline))
    try:
        got = conn.recv(1)
    except TimeoutError as exc:
        raise RendezvousError(f"waited past the deadline for {token!r} from the previous rank") from exc
    if got != token:
        raise RendezvousError(f"the previous rank sent {got!r}, not {token!r}")


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), POLL_S)
