"""An MLX rank waiting for a slower one keeps its Python threads running (engines/mlx/rendezvous.py).

mx.distributed.init(backend="ring") holds the GIL while it waits for its peers, so the runner's heartbeat thread
went silent for as long as the slowest rank took to start, and the supervisor killed a rank that waited past its
15 s hung limit: on three real nodes starting seven MLX ranks on 2 loaded cores, instances restarted until their
test timed out (tests/integration/test_mlx_family_nodes.py). Two rank processes here: the second starts LATE_S
after the first, whose own ticker thread must keep ticking while it waits, and the ring they form must work."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from skulk.engines.mlx.rendezvous import RendezvousError, meet
from skulk.testing.nodes import free_port

pytest.importorskip("mlx.core")

pytestmark = pytest.mark.timeout(90)

LATE_S = 8.0
"""Without the rendezvous the first rank's threads stop for all of it; with it they stop only inside MLX's own
init once both ranks are up (its connect retries hold the GIL: 2.1 s measured under CI load), so half of it
separates the two."""
RANK = """
import sys, threading, time
import mlx.core as mx
from skulk.engines.mlx.ring import connect
hosts, rank = sys.argv[1].split(","), int(sys.argv[2])
gaps, last = [0.0], [time.monotonic()]
def tick():
    while True:
        now = time.monotonic(); gaps[0] = max(gaps[0], now - last[0]); last[0] = now; time.sleep(0.05)
threading.Thread(target=tick, daemon=True).start()
group = connect(rank, hosts)
total = int(mx.distributed.all_sum(mx.array([rank + 1]), group=group).item())
print(f"gap={gaps[0]:.2f} sum={total}", flush=True)
"""


def test_a_rank_waiting_for_a_late_peer_keeps_its_threads_running() -> None:
    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    first = subprocess.Popen([sys.executable, "-c", RANK, hosts, "0"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(LATE_S)
        second = subprocess.run([sys.executable, "-c", RANK, hosts, "1"], capture_output=True, text=True, timeout=60)
        out, _ = first.communicate(timeout=30)
    finally:
        first.kill()
    assert second.returncode == 0 and first.returncode == 0, (second.stderr, out)
    gap = float(out.split("gap=")[1].split()[0])
    assert "sum=3" in out and "sum=3" in second.stdout, (out, second.stdout)
    assert gap < LATE_S / 2, f"the first rank's threads stopped for {gap:.2f} s while it waited"


def test_a_peer_that_never_comes_is_named_in_time() -> None:
    hosts = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"never listened|never connected"):
        meet(0, hosts, timeout_s=1.0)
    assert time.monotonic() - started < 5


def test_three_ranks_meet_in_any_order_past_a_stray_connection() -> None:
    """Rank 0 starts first and something else connects to its address before its predecessor does; the others
    start in reverse order. Every rank returns, none before the last has started, and every address is free
    again for MLX to bind."""
    import socket
    import threading

    hosts = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    done: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            meet(r, hosts, timeout_s=20)
            done[r] = time.monotonic()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 2, 1)]
    threads[0].start()
    time.sleep(0.3)
    ip, port = hosts[0].split(":")
    stray = socket.create_connection((ip, int(port)), timeout=5)
    stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
    last_started = 0.0
    for t in threads[1:]:
        time.sleep(0.3)
        last_started = time.monotonic()  # taken before the start: a rank cannot return before it
        t.start()
    for t in threads:
        t.join(30)
    stray.close()
    assert not errors and sorted(done) == [0, 1, 2], errors
    assert min(done.values()) >= last_started
    for host in hosts:
        with socket.create_server((host.split(":")[0], int(host.split(":")[1]))):
            pass
