"""decide(): who is master and in which term, from the same inputs on every node."""

from __future__ import annotations

from skulk.cluster.election import (
    Candidate,
    Decision,
    decide,
    decode_candidate,
    encode_candidate,
    ready_to_settle,
)
from skulk.types.ids import NodeId

A, B, C, D = NodeId("a"), NodeId("b"), NodeId("c"), NodeId("d")


def cand(
    node: NodeId,
    term: int = 0,
    joined_at: float = 0.0,
    master: NodeId | None = None,
    applied: int = -1,
    rejoining: bool = False,
) -> Candidate:
    return Candidate(
        node_id=node, term=term, joined_at=joined_at, master=master, applied_idx=applied, rejoining=rejoining
    )


def test_lone_node_elects_itself_in_term_one() -> None:
    assert decide([cand(A)], frozenset({A}), A) == Decision(A, 1, kept=False)


def test_fresh_cluster_elects_the_most_senior() -> None:
    cands = [cand(A, joined_at=3.0), cand(B, joined_at=1.0), cand(C, joined_at=2.0)]
    assert decide(cands, frozenset({A, B, C}), A) == Decision(B, 1, kept=False)


def test_node_id_breaks_a_seniority_tie() -> None:
    cands = [cand(C, joined_at=1.0), cand(B, joined_at=1.0)]
    assert decide(cands, frozenset({B, C}), C).master == B


def test_fresh_election_uses_a_term_above_every_live_one() -> None:
    cands = [cand(A, term=2, joined_at=9.0), cand(B, term=1, joined_at=1.0)]
    assert decide(cands, frozenset({A, B}), B) == Decision(B, 3, kept=False)


def test_a_candidate_behind_a_live_peer_cannot_win() -> None:
    """Raft's up-to-date rule: the senior node missed events, so electing it would drop them."""
    cands = [cand(A, 2, joined_at=0.0, applied=40), cand(B, 2, joined_at=5.0, applied=42)]
    for me in (A, B):
        assert decide(cands, frozenset({A, B}), me) == Decision(B, 3, kept=False)


def test_a_rejoining_node_cannot_win_while_others_can() -> None:
    cands = [cand(A, 2, joined_at=0.0, applied=99, rejoining=True), cand(B, 2, joined_at=5.0, applied=42)]
    assert decide(cands, frozenset({A, B}), A) == Decision(B, 3, kept=False)


def test_a_lone_rejoining_node_may_elect_itself() -> None:
    assert decide([cand(A, 4, rejoining=True)], frozenset({A}), A) == Decision(A, 5, kept=False)


def test_paused_node_that_elected_itself_alone_loses_to_the_majority() -> None:
    """A laptop wakes up, saw every lease expire and made itself master of a higher term: when it reconnects,
    the master followed by the other two stays, whatever the terms."""
    cands = [
        cand(A, 9, joined_at=0.0, master=A, applied=500),
        cand(B, 3, joined_at=1.0, master=B, applied=430),
        cand(C, 3, joined_at=2.0, master=B, applied=430),
    ]
    for me in (A, B, C):
        assert decide(cands, frozenset({A, B, C}), me) == Decision(B, 3, kept=True)


def test_equal_support_goes_to_the_more_advanced_master() -> None:
    cands = [cand(A, 2, joined_at=0.0, master=A, applied=10), cand(B, 2, joined_at=1.0, master=B, applied=12)]
    for me in (A, B):
        assert decide(cands, frozenset({A, B}), me) == Decision(B, 2, kept=True)


def test_a_master_that_stepped_down_is_not_kept_by_its_old_followers() -> None:
    cands = [cand(A, 2, 0.0, master=None, rejoining=True), cand(B, 2, 1.0, master=A), cand(C, 2, 2.0, master=A)]
    assert decide(cands, frozenset({A, B, C}), B) == Decision(B, 3, kept=False)


def test_healthy_master_is_kept() -> None:
    cands = [cand(A, 4, 5.0, master=C), cand(B, 4, 6.0, master=C), cand(C, 4, 7.0, master=C)]
    assert decide(cands, frozenset({A, B, C}), A) == Decision(C, 4, kept=True)


def test_rejoining_senior_node_does_not_take_over() -> None:
    cands = [cand(A, 0, joined_at=0.0), cand(B, 2, joined_at=5.0, master=B)]
    assert decide(cands, frozenset({A, B}), A) == Decision(B, 2, kept=True)


def test_one_acknowledgement_at_the_highest_term_is_enough() -> None:
    """A node that already adopted the new master pulls the slower ones along into the same term."""
    cands = [cand(A, 3, 2.0, master=B), cand(B, 2, 0.0, master=D), cand(C, 2, 1.0, master=D)]
    for me in (A, B, C):
        assert decide(cands, frozenset({A, B, C}), me) == Decision(B, 3, kept=False)


def test_dead_master_triggers_a_new_term_among_the_living() -> None:
    cands = [cand(A, 2, 2.0, master=C), cand(B, 2, 1.0, master=C), cand(C, 2, 0.0, master=C)]
    assert decide(cands, frozenset({A, B}), A) == Decision(B, 3, kept=False)


def test_dead_nodes_candidates_are_ignored() -> None:
    cands = [cand(A, 1, 5.0, master=A), cand(D, 9, 0.0, master=D)]
    assert decide(cands, frozenset({A}), A) == Decision(A, 1, kept=True)


def test_self_counts_as_alive_even_before_membership_reports_it() -> None:
    assert decide([cand(A)], frozenset(), A) == Decision(A, 1, kept=False)


def test_two_masters_in_the_same_term_resolve_to_the_one_with_more_followers() -> None:
    cands = [cand(A, 1, 1.0, master=A), cand(B, 1, 2.0, master=B), cand(C, 1, 3.0, master=B)]
    for me in (A, B, C):
        assert decide(cands, frozenset({A, B, C}), me) == Decision(B, 1, kept=True)


def test_dead_master_acknowledged_beside_a_live_one_keeps_the_live_one() -> None:
    cands = [cand(A, 3, master=B), cand(B, 3, master=B), cand(C, 3, master=D)]
    assert decide(cands, frozenset({A, B, C}), C) == Decision(B, 3, kept=True)


def test_every_node_reaches_the_same_decision() -> None:
    cands = [cand(A, 1, 4.0, master=D), cand(B, 1, 2.0, master=D), cand(C, 0, 1.0)]
    alive = frozenset({A, B, C})
    decisions = {decide(cands, alive, me) for me in alive}
    assert decisions == {Decision(C, 2, kept=False)}


def test_candidate_round_trips_as_json() -> None:
    c = cand(A, 7, 1.5, master=B)
    assert decode_candidate(encode_candidate(c)) == c
    assert decode_candidate(b"not json") is None


def test_settling_waits_for_the_scouting_window_and_every_peer() -> None:
    both, only_a = frozenset({A, B}), frozenset({A})
    assert not ready_to_settle(0.1, both, both, found_master=False, wait_s=3.0)
    assert ready_to_settle(0.6, both, both, found_master=False, wait_s=3.0)
    assert not ready_to_settle(0.6, both, only_a, found_master=False, wait_s=3.0)
    assert ready_to_settle(3.0, both, only_a, found_master=False, wait_s=3.0)
    assert ready_to_settle(0.0, both, only_a, found_master=True, wait_s=3.0)


def test_a_node_alone_waits_the_whole_timeout_for_an_existing_cluster() -> None:
    """A restarted node hears nobody at first (its peers redial within a second): it must not elect itself."""
    only_a = frozenset({A})
    assert not ready_to_settle(0.6, only_a, only_a, found_master=False, wait_s=3.0)
    assert not ready_to_settle(2.9, only_a, only_a, found_master=False, wait_s=3.0)
    assert ready_to_settle(3.0, only_a, only_a, found_master=False, wait_s=3.0)
