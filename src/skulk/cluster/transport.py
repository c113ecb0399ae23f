"""The zenoh session of one node and the key space of its cluster.

Every control-plane key lives under `skulk/<cluster>/`. zenoh calls back on its own threads; each callback
only hands the message to the asyncio loop, so the rest of the node never touches a zenoh thread.

This is also the one place payloads are sealed: with a cluster key every put, subscription, query and reply
goes through `cluster/seal.py`, and what does not open is dropped here, before any part of the node sees it.
And the one place message versions are kept (`types/versions.py`): every put, query and reply carries this
release's format version as its zenoh attachment, and a message of a version not worked with is dropped here
with one log line per version (`VersionGate`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zenoh

from skulk.cluster.seal import ReplayWindow, Sealer
from skulk.types import versions

log = logging.getLogger(__name__)

LEASE_MS = 3000
"""A hung or cut-off peer is declared gone after this long; a killed one is seen at once (TCP close)."""

DEFAULT_SCOUT_PORT = 7446


@dataclass(frozen=True)
class TransportSettings:
    cluster: str = "default"
    listen: list[str] = field(default_factory=lambda: ["tcp/0.0.0.0:0"])
    bootstrap_peers: list[str] = field(default_factory=list)
    multicast: bool = True
    multicast_interface: str | None = None
    cluster_key: str | None = None
    """With a key, every payload is sealed (ChaCha20-Poly1305, replay-protected); without, plain as before."""
    format_version: int = versions.FORMAT_VERSION
    """The version this node's messages say (a test stands up a node of another release's version with it)."""

    @property
    def scout_port(self) -> int:
        """Each cluster name scouts on its own multicast port, so differently named clusters do not find each other
        by multicast (7446, zenoh's default, for `default`; names collide about once in 20,000). It is no barrier:
        a bootstrap peer or gossip can still join two clusters' meshes, and only a cluster key keeps a stranger out."""
        if self.cluster == "default":
            return DEFAULT_SCOUT_PORT
        return 20000 + zlib.crc32(self.cluster.encode()) % 20000


def zenoh_config(settings: TransportSettings) -> zenoh.Config:
    conf = zenoh.Config()
    values: dict[str, Any] = {
        "mode": "peer",
        "listen/endpoints": settings.listen,
        "connect/endpoints": settings.bootstrap_peers,
        "scouting/multicast/enabled": settings.multicast,
        "scouting/multicast/address": f"224.0.0.224:{settings.scout_port}",
        "scouting/gossip/enabled": True,
        "transport/link/tx/lease": LEASE_MS,
        "transport/link/tx/keep_alive": 4,
        # redial a lost bootstrap peer every second at most (zenoh's default backs off to 4 s): a node that
        # restarts, or resumes from a pause, must find its cluster within the 3 s election timeout
        "connect/retry": {"period_init_ms": 250, "period_max_ms": 1000, "period_increase_factor": 2},
    }
    if settings.multicast_interface:
        values["scouting/multicast/interface"] = settings.multicast_interface
    for key, value in values.items():
        conf.insert_json5(key, json.dumps(value))
    return conf


class HandOver:
    """From zenoh threads to the loop, in arrival order, with one loop wake-up per burst instead of one per message.

    Each `call_soon_threadsafe` writes a byte to the loop's self-pipe and makes the loop read it back: py-spy put
    that wake-up (`_write_to_self` and the selector's turn) at 15-40 % of the API node's CPU per token of 8
    streams, whose tokens of one step arrive back to back. Messages queued while a wake-up is pending ride it.
    A message that arrives while the node shuts down is dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._armed = False
        self.wakeups = 0
        """Loop wake-ups asked for (a test reads it: fewer than messages when they come in a burst)."""

    def __call__(self, callback: Callable[..., None], *args: Any) -> None:
        """Any thread: queue callback(*args) to run on the loop after every earlier one."""
        with self._lock:
            self._pending.append((callback, args))
            if self._armed:
                return
            self._armed = True
            self.wakeups += 1
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the node is shutting down
            pass

    def _drain(self) -> None:
        """On the loop: run what is queued; one callback that raises does not drop the others."""
        with self._lock:
            batch, self._pending = self._pending, collections.deque()
            self._armed = False
        for callback, args in batch:
            try:
                callback(*args)
            except Exception as error:  # as the loop itself would for a call_soon callback: reported, not fatal
                self._loop.call_exception_handler(
                    {"message": f"exception in zenoh callback {callback!r}", "exception": error})


class VersionGate:
    """Which peers' messages are taken, by the format version in their attachment: same or one apart, else
    dropped and counted, with one WARNING line the first time each refused version is met (a refused peer sends
    several messages a second; one line says all there is to say)."""

    def __init__(self, ours: int = versions.FORMAT_VERSION) -> None:
        self.ours = ours
        self.attachment = versions.attachment(ours)
        self.refused: dict[str, int] = {}
        """Refused messages by the version they said ("unreadable" when it did not parse)."""
        self.met: set[int | None] = set()
        """Versions one apart that were heard (and worked with)."""
        self._lock = threading.Lock()

    def admits(self, raw: bytes | None, key: str) -> bool:
        """Any thread: whether a message with attachment `raw`, on `key`, is taken."""
        theirs = versions.version_of_attachment(raw)
        verdict = versions.judge(theirs, self.ours)
        if verdict is versions.Compat.same:
            return True
        if verdict is versions.Compat.compatible:
            if theirs not in self.met:  # once per version: a cluster in the middle of a rolling upgrade
                self.met.add(theirs)
                log.info("peers speaking format version %s are worked with (this node speaks %d)", theirs, self.ours)
            return True
        label = str(theirs) if theirs is not None else "unreadable"
        with self._lock:
            first = label not in self.refused
            self.refused[label] = self.refused.get(label, 0) + 1
        if first:
            log.warning("%s", versions.refusal_line(f"a peer's message on {key}", theirs, self.ours))
        return False


@dataclass(frozen=True)
class _LocalSubscription:
    key_expr: zenoh.KeyExpr
    on_message: Callable[[str, bytes], None]
    hand_over: HandOver


def _attachment_of(item: Any) -> bytes | None:
    found = item.attachment
    return found.to_bytes() if found is not None else None


class Transport:
    """One zenoh session. Keys passed in are relative to `skulk/<cluster>/`."""

    def __init__(self, settings: TransportSettings) -> None:
        self.settings = settings
        self.prefix = f"skulk/{settings.cluster}"
        self._session: zenoh.Session | None = None
        self._hand_over: HandOver | None = None
        self._declared: list[Any] = []
        self._windows: dict[str, ReplayWindow] = {}
        self.sealer = Sealer.from_cluster_key(settings.cluster_key) if settings.cluster_key else None
        self.versions = VersionGate(settings.format_version)
        self._publishers: dict[str, Any] = {}
        """Publishers declared only to read their matching status (`matched`), by key suffix."""
        self._local: dict[int, _LocalSubscription] = {}
        """This session's own subscriptions, by id of their zenoh subscriber: what this node puts reaches them
        straight through the hand-over (`put`)."""

    def _seal(self, key_expr: str, payload: bytes) -> bytes:
        return self.sealer.seal(key_expr, payload) if self.sealer is not None else payload

    def _open(self, key_expr: str, payload: bytes, window: ReplayWindow | None = None) -> bytes | None:
        return self.sealer.open(key_expr, payload, window) if self.sealer is not None else payload

    @property
    def session(self) -> zenoh.Session:
        if self._session is None:
            raise RuntimeError("transport is not open")
        return self._session

    @property
    def is_open(self) -> bool:
        return self._session is not None

    def key(self, suffix: str) -> str:
        return f"{self.prefix}/{suffix}"

    def open(self) -> None:
        zenoh.try_init_log_from_env()
        self._hand_over = HandOver(asyncio.get_running_loop())
        self._session = zenoh.open(zenoh_config(self.settings))

    def close(self) -> None:
        self._local.clear()
        self._publishers.clear()
        for entity in reversed(self._declared):
            try:
                entity.undeclare()
            except zenoh.ZError:
                pass
        self._declared.clear()
        if self._session is not None:
            self._session.close()
            self._session = None

    def zenoh_id(self) -> str:
        return str(self.session.info.zid())

    def locators(self) -> list[str]:
        locators = getattr(self.session.info, "locators", None)  # not in every zenoh release
        return [str(loc) for loc in locators()] if locators is not None else []

    @property
    def mixed_versions(self) -> bool:
        """This node has heard a peer of another (compatible) format version: a cluster in a rolling upgrade,
        whose older nodes know only the older keys (cluster/dataplane.py)."""
        return bool(self.versions.met)

    def put(self, suffix: str, payload: bytes) -> None:
        """To every subscriber of the key: other sessions through zenoh, sealed; this session's own subscriptions
        straight to the loop's hand-over, as they are. zenoh's own delivery to a subscriber of the same session
        crosses its threads and the seal twice: 0.3-0.4 ms of a single node's request path, taken twice per
        request (the command to the master, the master's event back to its own follower; issue 43)."""
        key = self.key(suffix)
        self.session.put(key, self._seal(key, payload), attachment=self.versions.attachment,
                         allowed_destination=zenoh.Locality.REMOTE)
        if self._local:
            target = zenoh.KeyExpr(key)
            for local in list(self._local.values()):
                if local.key_expr.intersects(target):
                    local.hand_over(local.on_message, suffix, payload)

    def matched(self, suffix: str) -> bool:
        """Another node's session subscribes to the key now: zenoh's matching status of a publisher declared once
        per key (1.4 us a call here). What lets a sender use a key that only nodes of this release subscribe to
        (cluster/dataplane.py's step batches) without knowing each peer's release."""
        publisher = self._publishers.get(suffix)
        if publisher is None:
            publisher = self.session.declare_publisher(self.key(suffix), allowed_destination=zenoh.Locality.REMOTE)
            self._declared.append(publisher)
            self._publishers[suffix] = publisher
        status = publisher.matching_status  # a MatchingStatus in zenoh 1.10 (its stub says bool)
        return bool(getattr(status, "matching", status))

    def count_replayed(self) -> None:
        """A message that opened but was refused for its context (addressed to another master or term)."""
        if self.sealer is not None:
            self.sealer.count_replayed()

    def subscribe(self, suffix: str, on_message: Callable[[str, bytes], None], *, durable: bool = False) -> Any:
        """on_message(key, payload) runs on the asyncio loop, never on a zenoh thread.

        Each subscription has its own replay window (a message matching two subscriptions reaches both); a
        durable one shares its window with every later durable subscription of the same suffix, so a
        subscription re-declared on this node (a master re-created in one term) refuses what its predecessor
        already took."""
        hand_over = self._require_hand_over()
        prefix_len = len(self.prefix) + 1
        window = self._windows.setdefault(suffix, ReplayWindow()) if durable else ReplayWindow()

        def callback(sample: zenoh.Sample) -> None:
            full = str(sample.key_expr)
            if not self.versions.admits(_attachment_of(sample), full):
                return
            payload = self._open(full, sample.payload.to_bytes(), window)
            if payload is not None:  # forged or replayed: dropped (and counted) here
                hand_over(on_message, full[prefix_len:], payload)

        sub = self.session.declare_subscriber(self.key(suffix), callback)
        self._declared.append(sub)
        self._local[id(sub)] = _LocalSubscription(zenoh.KeyExpr(self.key(suffix)), on_message, hand_over)
        return sub

    def undeclare(self, entity: Any) -> None:
        self._local.pop(id(entity), None)
        if entity in self._declared:
            self._declared.remove(entity)
        try:
            entity.undeclare()
        except zenoh.ZError:
            pass

    def declare_token(self, suffix: str) -> Any:
        token = self.session.liveliness().declare_token(self.key(suffix))
        self._declared.append(token)
        return token

    def watch_liveliness(self, suffix: str, on_change: Callable[[str, bool], None]) -> Any:
        """on_change(key, alive) for every token under suffix, including the ones alive now."""
        hand_over = self._require_hand_over()
        prefix_len = len(self.prefix) + 1

        def callback(sample: zenoh.Sample) -> None:
            alive = sample.kind == zenoh.SampleKind.PUT
            hand_over(on_change, str(sample.key_expr)[prefix_len:], alive)

        sub = self.session.liveliness().declare_subscriber(self.key(suffix), callback, history=True)
        self._declared.append(sub)
        return sub

    def serve(self, suffix: str, answer: Callable[[str, str], bytes | None]) -> Any:
        """answer(key, parameters) runs on a zenoh thread and must only read; None sends no reply."""

        def handler(query: zenoh.Query) -> None:
            key = str(query.key_expr)
            if not self.versions.admits(_attachment_of(query), key):
                return
            reply = answer(key[len(self.prefix) + 1 :], str(query.parameters))
            if reply is not None:
                query.reply(key, self._seal(key, reply), attachment=self.versions.attachment)

        queryable = self.session.declare_queryable(self.key(suffix), handler)
        self._declared.append(queryable)
        return queryable

    async def query(self, suffix: str, parameters: str = "", timeout_s: float = 2.0) -> list[bytes]:
        selector = self.key(suffix) + (f"?{parameters}" if parameters else "")

        def blocking() -> list[bytes]:
            replies = self.session.get(selector, timeout=timeout_s, attachment=self.versions.attachment)
            opened = [self._open(str(r.ok.key_expr), r.ok.payload.to_bytes()) for r in replies
                      if r.ok is not None and self.versions.admits(_attachment_of(r.ok), str(r.ok.key_expr))]
            return [payload for payload in opened if payload is not None]

        return await asyncio.to_thread(blocking)

    def _require_hand_over(self) -> HandOver:
        if self._hand_over is None:
            raise RuntimeError("open() the transport inside the event loop first")
        return self._hand_over
