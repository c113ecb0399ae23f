"""Sealing of every zenoh payload with the cluster key: a host without it can neither read nor be believed.

With a cluster key, each payload a node puts, publishes or answers a query with is encrypted and authenticated
with ChaCha20-Poly1305 under a key derived (HKDF-SHA256) from the cluster key. The zenoh key expression is the
associated data, so a sealed message cannot be replayed under another key (an event as a command, a chunk of one
stream into another). Replays are refused: the nonce is a random per-process sender id and a counter, the
plaintext starts with the sender's clock, and a receiver accepts a sender's counter once, within a window, and
only from messages younger than MAX_AGE_S (so a replay of a whole earlier session fails too). What fails any
check is dropped and counted, never handed to the node.

Wire layout: MAGIC(2) | sender(4) | counter(8) | ChaCha20-Poly1305(ts_ms(8) | payload) with its 16-byte tag.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"S1"
HEADER = len(MAGIC) + 4 + 8
MAX_AGE_S = 60.0
"""A sealed message older (or further in the future) than this is refused: clocks on a LAN agree far better."""
WINDOW = 4096
"""Counters this far behind a sender's newest are refused; inside it, each counter is accepted once."""
SENDER_TTL_S = 2 * MAX_AGE_S


def generate_key() -> str:
    """A new cluster key: 32 random bytes, URL-safe base64 (what `skulk keygen` prints)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def derive(cluster_key: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"skulk cluster key v1", info=b"zenoh payloads").derive(
        cluster_key.encode())


@dataclass
class _Sender:
    newest: int
    seen: set[int]
    last_heard: float


@dataclass
class ReplayWindow:
    """What one receiver (one subscription) has accepted: each sealed message once. Per subscription, because
    zenoh hands one message to every matching subscription of a node, and each must get it."""

    senders: dict[bytes, _Sender] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class SealStats:
    sealed: int = 0
    opened: int = 0
    forged: int = 0  # failed authentication: wrong key, tampered, or not sealed at all
    replayed: int = 0  # authentic, but seen before, too old, or outside the window


@dataclass
class Sealer:
    """Seals and opens payloads for one node. Thread-safe: zenoh calls back on its own threads."""

    key: bytes
    clock: object = time.time
    stats: SealStats = field(default_factory=SealStats)
    _aead: ChaCha20Poly1305 = field(init=False)
    _me: bytes = field(default_factory=lambda: os.urandom(4))
    _counter: int = 0
    _window: ReplayWindow = field(default_factory=ReplayWindow)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._aead = ChaCha20Poly1305(self.key)

    @classmethod
    def from_cluster_key(cls, cluster_key: str) -> Sealer:
        return cls(derive(cluster_key))

    def _now(self) -> float:
        return self.clock()  # pyright: ignore[reportCallIssue]

    def seal(self, key_expr: str, payload: bytes) -> bytes:
        with self._lock:
            self._counter += 1
            counter = self._counter
            self.stats.sealed += 1
        nonce = self._me + struct.pack(">Q", counter)
        plain = struct.pack(">q", int(self._now() * 1000)) + payload
        return MAGIC + nonce + self._aead.encrypt(nonce, plain, key_expr.encode())

    def open(self, key_expr: str, sealed: bytes, window: ReplayWindow | None = None) -> bytes | None:
        """The payload, or None (counted) when it is forged, tampered, replayed (in `window`, by default the
        sealer's own) or stale."""
        if len(sealed) < HEADER + 8 + 16 or not sealed.startswith(MAGIC):
            return self._count_forged()
        nonce = sealed[2:HEADER]
        try:
            plain = self._aead.decrypt(nonce, sealed[HEADER:], key_expr.encode())
        except InvalidTag:
            return self._count_forged()
        sent_ms = struct.unpack(">q", plain[:8])[0]
        now = self._now()
        seen = window if window is not None else self._window
        if abs(now - sent_ms / 1000) > MAX_AGE_S or not _first_time(seen, nonce[:4], nonce[4:], now):
            with self._lock:
                self.stats.replayed += 1
            return None
        with self._lock:
            self.stats.opened += 1
        return plain[8:]

    def count_replayed(self) -> None:
        """Authentic, but refused by its receiver for its context (addressed to another master or term)."""
        with self._lock:
            self.stats.replayed += 1

    def _count_forged(self) -> None:
        with self._lock:
            self.stats.forged += 1
        return None



def _first_time(window: ReplayWindow, sender: bytes, counter_bytes: bytes, now: float) -> bool:
    counter = struct.unpack(">Q", counter_bytes)[0]
    with window.lock:
        state = window.senders.get(sender)
        if state is None:
            for quiet in [s for s, st in window.senders.items() if now - st.last_heard > SENDER_TTL_S]:
                del window.senders[quiet]
            window.senders[sender] = _Sender(counter, {counter}, now)
            return True
        state.last_heard = now
        if counter <= state.newest - WINDOW or counter in state.seen:
            return False
        state.seen.add(counter)
        if counter > state.newest:
            state.newest = counter
            if len(state.seen) > 2 * WINDOW:
                state.seen = {c for c in state.seen if c > state.newest - WINDOW}
        return True


def reachable_beyond_loopback(api_host: str, zenoh_listen: list[str]) -> bool:
    """Whether a host other than this one can reach the node's API or zenoh endpoints (pure)."""

    def loopback(host: str) -> bool:
        host = host.strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    hosts = [api_host] + [endpoint.split("/", 1)[-1].rsplit(":", 1)[0] for endpoint in zenoh_listen]
    return not all(loopback(host) for host in hosts)
