"""Membership with a cluster key trusts only sealed heartbeats (issue 27): a liveliness token alone, which any
zenoh client can declare, neither adds a member nor keeps one alive past the lease."""

from __future__ import annotations

from typing import Any

from skulk.cluster.intake import addressed_here
from skulk.cluster.membership import VOUCH_LEASE_S, Membership
from skulk.types.ids import NodeId


class FakeTransport:
    def __init__(self, sealed: bool) -> None:
        self.sealer: Any = object() if sealed else None
        self.is_open = True
        self.tokens: list[str] = []

    def declare_token(self, suffix: str) -> object:
        self.tokens.append(suffix)
        return object()

    def watch_liveliness(self, suffix: str, on_change: Any) -> object:
        return object()

    def undeclare(self, entity: object) -> None:
        pass


def membership(sealed: bool = True) -> Membership:
    m = Membership(FakeTransport(sealed), NodeId("me"))  # pyright: ignore[reportArgumentType]
    m.start()
    return m


async def test_a_token_without_a_sealed_heartbeat_adds_no_member() -> None:
    m = membership()
    m._on_token("alive/ghost", True)
    assert m.alive == {"me"} and m.tokens == {"me", "ghost"}


async def test_a_member_needs_both_token_and_heartbeat_and_leaves_one_lease_after_its_last_heartbeat() -> None:
    m = membership()
    changes: list[tuple[str, bool]] = []
    m.on_change(lambda node, alive: changes.append((node, alive)))
    m.vouch(NodeId("peer"), 100.0)
    assert m.alive == {"me"}, "a heartbeat without a token (a node that already left) is no member"
    m._on_token("alive/peer", True)
    assert m.alive == {"me", "peer"}
    m.expire(100.0 + VOUCH_LEASE_S)
    assert "peer" in m.alive
    m.expire(100.0 + VOUCH_LEASE_S + 0.01)  # its heartbeats stopped; a phantom still holds its token
    assert m.alive == {"me"} and "peer" in m.tokens
    assert changes == [("peer", True), ("peer", False)]


async def test_a_freeze_of_this_node_gives_every_member_a_fresh_lease() -> None:
    m = membership()
    m._on_token("alive/peer", True)
    m.vouch(NodeId("peer"), 100.0)
    m.forgive(200.0)
    m.expire(200.0 + VOUCH_LEASE_S)
    assert "peer" in m.alive


async def test_a_token_that_goes_away_leaves_at_once_even_if_vouched() -> None:
    m = membership()
    m._on_token("alive/peer", True)
    m.vouch(NodeId("peer"), 100.0)
    m._on_token("alive/peer", False)
    assert m.alive == {"me"}


async def test_a_starting_node_waits_to_hear_new_tokens_but_not_phantoms() -> None:
    import asyncio

    m = membership()
    m._on_token("alive/peer", True)
    now = asyncio.get_running_loop().time()
    assert m.unheard(now) == {"peer"}, "its first heartbeat is on its way: an election waits for it"
    assert m.unheard(now + VOUCH_LEASE_S + 0.1) == frozenset(), "a lease without a heartbeat: a phantom"
    m.vouch(NodeId("peer"), now)
    assert m.unheard(now) == frozenset()


async def test_without_a_cluster_key_tokens_alone_decide() -> None:
    m = membership(sealed=False)
    m._on_token("alive/peer", True)
    assert m.alive == {"me", "peer"}


def test_a_command_is_for_the_master_and_term_it_was_addressed_to() -> None:
    here = NodeId("m2")
    assert addressed_here(5, here, 5, here)
    assert not addressed_here(5, here, 4, NodeId("m1")), "addressed to the previous master's term"
    assert not addressed_here(5, here, 5, NodeId("m1")), "the other side of a partition, same term"
    assert not addressed_here(5, here, 4, here)
    assert not addressed_here(5, here, 0, None), "unaddressed: sent by a node without a master"
    assert addressed_here(0, None, 3, NodeId("x")), "an intake without an address takes everything"
