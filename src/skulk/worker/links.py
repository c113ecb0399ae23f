"""Round trip and bandwidth to each peer, measured on the probes the node sends anyway.

The topology probe asks every peer for its node id (a signed GET /node/probe) once a second on a kept-alive
connection: timing that reply is the round-trip sample, at no extra cost. Every BANDWIDTH_EVERY_S a peer is also
asked for BANDWIDTH_BYTES (GET /node/link_probe, signed too), the round trip taken off the read time: half a
megabyte per peer every half minute. Only exchanges the peer proves it answered are samples.
`LinkMeter` keeps the samples; what is worth a node-info event (`worth_reporting`) is decided purely.

Under a benchmark's emulated latency (SKULK_LINK_DELAY_MS, engines/torch/delay.py: only the ranks' messages are
delayed, not HTTP) the round trip reported is the probe's plus the emulated one, so predictions see the link the
ranks see.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import httpx

from skulk import internal_auth, peer_tls
from skulk.engines.link_delay import emulated_delay_s
from skulk.types.ids import NodeId
from skulk.types.links import RTT_FLOOR_MS, LinkMeasurement

RTT_SAMPLES = 8
"""Round-trip samples the median is taken over: one slow reply (a GC pause, a busy loop) does not move it."""
BANDWIDTH_EVERY_S = 30.0
"""The default of Settings.link_bandwidth_seconds."""
BANDWIDTH_BYTES = 512 * 1024
REPORT_CHANGE = 0.2
"""A link figure that moved by more than this fraction is worth a node-info event before the heartbeat."""
REPORT_RTT_MS = 0.5
"""...and a round trip only when it also moved by more than this: a sub-millisecond round trip (loopback, one
switch) jitters by more than a fifth from one second to the next, which made every node emit an event a second
without changing any prediction."""


class LinkMeter:
    """The samples this node took of its links, by peer."""

    def __init__(self, bandwidth_every_s: float = BANDWIDTH_EVERY_S, emulated_rtt_ms: float | None = None) -> None:
        self.bandwidth_every_s = bandwidth_every_s
        self.emulated_rtt_ms = 2000 * emulated_delay_s() if emulated_rtt_ms is None else emulated_rtt_ms
        self._rtt: dict[NodeId, deque[float]] = {}
        self._bandwidth: dict[NodeId, float] = {}
        self._bandwidth_at: dict[NodeId, float] = {}
        self._at: dict[NodeId, float] = {}
        self._self: deque[float] = deque(maxlen=RTT_SAMPLES)

    def add_self_rtt(self, seconds: float) -> None:
        """The same probe to this node's own API: the HTTP stacks' cost, taken off every peer's round trip."""
        self._self.append(seconds)

    def add_rtt(self, peer: NodeId, seconds: float, now: float | None = None) -> None:
        self._rtt.setdefault(peer, deque(maxlen=RTT_SAMPLES)).append(seconds)
        self._at[peer] = time.time() if now is None else now

    def add_bandwidth(self, peer: NodeId, mbps: float, now: float | None = None) -> None:
        self._bandwidth[peer] = mbps
        self._at[peer] = time.time() if now is None else now

    def bandwidth_tried(self, peer: NodeId, now: float) -> None:
        """A bulk read was started: the next is due BANDWIDTH_EVERY_S later, whether this one succeeds or not."""
        self._bandwidth_at[peer] = now

    def forget_except(self, peers: set[NodeId]) -> None:
        """Drop peers that left (a returning peer starts its samples afresh)."""
        for table in (self._rtt, self._bandwidth, self._bandwidth_at, self._at):
            for peer in [p for p in table if p not in peers]:
                del table[peer]

    def bandwidth_due(self, peer: NodeId, now: float) -> bool:
        return now - self._bandwidth_at.get(peer, 0.0) >= self.bandwidth_every_s

    def median_rtt_s(self, peer: NodeId) -> float | None:
        samples = self._rtt.get(peer)
        return statistics.median(samples) if samples else None

    def snapshot(self) -> dict[NodeId, LinkMeasurement]:
        links: dict[NodeId, LinkMeasurement] = {}
        stacks_ms = statistics.median(self._self) * 1000 if self._self else 0.0
        for peer, samples in self._rtt.items():
            if samples:
                probe_ms = statistics.median(samples) * 1000
                links[peer] = LinkMeasurement(
                    rtt_ms=round(max(probe_ms - stacks_ms, RTT_FLOOR_MS) + self.emulated_rtt_ms, 3),
                    probe_rtt_ms=round(probe_ms, 3),
                    bandwidth_mbps=self._bandwidth.get(peer), measured_at_s=self._at[peer])
        return links


def _moved(old: float | None, new: float | None, least: float = 0.0) -> bool:
    if old is None or new is None:
        return old != new
    return abs(new - old) > max(REPORT_CHANGE * abs(old), least, 1e-9)


def worth_reporting(old: dict[NodeId, LinkMeasurement] | None, new: dict[NodeId, LinkMeasurement] | None) -> bool:
    """True when a peer came or went, or a round trip or bandwidth moved by more than REPORT_CHANGE: samples
    that only jitter ride along with the next heartbeat instead of an event a second."""
    old, new = old or {}, new or {}
    if set(old) != set(new):
        return True
    return any(_moved(old[p].rtt_ms, new[p].rtt_ms, REPORT_RTT_MS)
               or _moved(old[p].bandwidth_mbps, new[p].bandwidth_mbps) for p in new)


async def time_self(client: httpx.AsyncClient, host: str, port: int, me: NodeId) -> float | None:
    """Seconds this node's own API takes to name it: the probe's cost without a network (None on failure)."""
    started = time.perf_counter()
    try:
        reply = await client.get(f"{peer_tls.base_url(host, port)}/node/probe", timeout=1.0,
                                 auth=internal_auth.signer(me))
    except httpx.HTTPError:
        return None
    ok = reply.status_code == 200 and reply.text.strip('"') == me and internal_auth.answered_by(reply, me)
    return time.perf_counter() - started if ok else None


async def read_bandwidth(client: httpx.AsyncClient, address: str, port: int, rtt_s: float,
                         peer: NodeId) -> float | None:
    """Megabits per second of one bulk read from the peer's API, its round trip taken off; None on failure (or
    when someone other than the peer answered: only a signed exchange is a measurement)."""
    url = f"{peer_tls.base_url(address, port)}/node/link_probe"
    started = time.perf_counter()
    try:
        reply = await client.get(url, params={"bytes": BANDWIDTH_BYTES}, timeout=5.0, auth=internal_auth.signer(peer))
    except httpx.HTTPError:
        return None
    elapsed = time.perf_counter() - started
    if reply.status_code != 200 or len(reply.content) != BANDWIDTH_BYTES or not internal_auth.answered_by(reply, peer):
        return None
    transfer = max(elapsed - rtt_s, elapsed * 0.05)  # a read can never be free: keep the figure finite
    return round(BANDWIDTH_BYTES * 8 / transfer / 1e6, 1)
