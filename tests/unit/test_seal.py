"""Sealing of zenoh payloads: what opens, and what is dropped and counted (forged, tampered, replayed, stale)."""

from __future__ import annotations

from skulk.cluster.seal import (
    MAX_AGE_S,
    WINDOW,
    ReplayWindow,
    Sealer,
    derive,
    generate_key,
    reachable_beyond_loopback,
)

KEY = generate_key()


def pair(now: list[float]) -> tuple[Sealer, Sealer]:
    return Sealer(derive(KEY), clock=lambda: now[0]), Sealer(derive(KEY), clock=lambda: now[0])


def test_a_sealed_payload_opens_once_under_its_key() -> None:
    now = [1000.0]
    alice, bob = pair(now)
    sealed = alice.seal("skulk/c/commands", b'{"secret": 1}')
    assert b"secret" not in sealed
    assert bob.open("skulk/c/commands", sealed) == b'{"secret": 1}'
    assert bob.open("skulk/c/commands", sealed) is None  # replayed
    assert bob.stats.opened == 1 and bob.stats.replayed == 1


def test_forged_tampered_and_moved_payloads_are_dropped_and_counted() -> None:
    now = [1000.0]
    alice, bob = pair(now)
    stranger = Sealer(derive(generate_key()), clock=lambda: now[0])
    sealed = bytearray(alice.seal("skulk/c/events", b"event"))
    assert bob.open("skulk/c/events", b'{"plain": "json"}') is None
    assert bob.open("skulk/c/events", stranger.seal("skulk/c/events", b"forged")) is None
    assert bob.open("skulk/c/commands", bytes(sealed)) is None  # the key expression is authenticated
    sealed[-1] ^= 1
    assert bob.open("skulk/c/events", bytes(sealed)) is None
    assert bob.stats.forged == 4 and bob.stats.opened == 0


def test_stale_and_out_of_window_messages_are_refused() -> None:
    now = [1000.0]
    alice, bob = pair(now)
    old = alice.seal("k", b"old")
    now[0] += MAX_AGE_S + 1
    assert bob.open("k", old) is None
    messages = [alice.seal("k", b"m") for _ in range(WINDOW + 2)]
    assert bob.open("k", messages[-1]) == b"m"
    assert bob.open("k", messages[1]) is None  # WINDOW behind the newest
    assert bob.open("k", messages[-2]) == b"m"  # late, but inside the window and new
    assert bob.stats.replayed == 2


def test_reachability() -> None:
    assert not reachable_beyond_loopback("127.0.0.1", ["tcp/127.0.0.1:7447"])
    assert reachable_beyond_loopback("127.0.0.1", ["tcp/0.0.0.0:0"])
    assert reachable_beyond_loopback("0.0.0.0", ["tcp/[::1]:7447"])


def test_each_subscription_gets_a_message_once() -> None:
    """zenoh hands one message to every matching subscription of a node: each has its own replay window."""
    now = [1000.0]
    alice, bob = pair(now)
    sealed = alice.seal("skulk/c/events", b"e")
    first, second = ReplayWindow(), ReplayWindow()
    assert bob.open("skulk/c/events", sealed, first) == b"e"
    assert bob.open("skulk/c/events", sealed, second) == b"e"
    assert bob.open("skulk/c/events", sealed, first) is None
