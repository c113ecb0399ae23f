"""Whose saved desired state a restarted cluster restores (issue 38): the ranking of copies, a follower's offer
validated entry by entry, restored only above what was restored so far, and a follower's good file kept until
then."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from skulk.state.apply import apply
from skulk.state.desired import DesiredStateFile, desired_of
from skulk.state.desired_offer import offer_events, own_copy_events
from skulk.types.commands import OfferDesiredState
from skulk.types.desired import RestoredCopy, rank_of
from skulk.types.events import DesiredStateRestored, Event, IndexedEvent, MetaInstanceCreated
from skulk.types.ids import CommandId, MetaInstanceId, ModelId, NodeId
from skulk.types.meta_instances import MetaInstance
from skulk.types.state import State
from skulk.types.versions import FORMAT_VERSION

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def meta(mid: str) -> dict[str, Any]:
    return MetaInstance(meta_instance_id=MetaInstanceId(mid), model_id=ModelId("m/x")).model_dump(
        mode="json", by_alias=True)


def offer(saved: dict[str, Any], origin: str = "peer") -> OfferDesiredState:
    # through JSON, as it arrives from the wire
    return OfferDesiredState.model_validate_json(OfferDesiredState(
        command_id=CommandId("c"), origin=NodeId(origin), saved=saved).model_dump_json())


def copy(whole: bool, at: datetime | None, source: str = "n") -> RestoredCopy:
    return RestoredCopy(source=NodeId(source), whole=whole, saved_at=at)


def applied(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))
    return state


def test_any_copy_beats_none_a_whole_one_a_partial_one_then_the_newer() -> None:
    ordered = [None, copy(False, None), copy(False, T0 + timedelta(days=9)), copy(True, None), copy(True, T0),
               copy(True, T0 + timedelta(seconds=1))]
    ranks = [rank_of(c) for c in ordered]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_a_whole_offer_to_a_master_with_nothing_restores_it_and_records_whose_it_was() -> None:
    events, why = offer_events(State(), offer({"savedAt": T0.isoformat(), "metaInstances": {"a": meta("a")}}))
    state = applied(State(), events)
    assert list(state.meta_instances) == ["a"] and "restored (whole)" in why
    assert state.desired_restored == copy(True, T0, "peer")


def test_an_offer_is_checked_entry_by_entry_and_a_bad_one_makes_it_partial() -> None:
    saved = {"metaInstances": {"good": meta("good"), "huge": {**meta("huge"), "minNodes": 10**6},
                               "liar": meta("other"), "junk": "x"},
             "modelCards": [1, 2], "tracingEnabled": "yes", "savedAt": "not a time"}
    events, _ = offer_events(State(), offer(saved))
    state = applied(State(), events)
    assert list(state.meta_instances) == ["good"] and state.tracing_enabled is None
    assert state.desired_restored == copy(False, None, "peer")


def test_hostile_shapes_restore_nothing_and_never_raise() -> None:
    for saved in ({}, {"metaInstances": None}, {"metaInstances": {str(i): {} for i in range(5000)}},
                  {"metaInstances": {"a": [meta("a")]}}, {"savedAt": 12}):
        events, _ = offer_events(State(), offer(saved))
        assert not [e for e in events if isinstance(e, MetaInstanceCreated)], saved


def test_an_offer_adds_only_what_is_missing_and_only_above_what_was_restored() -> None:
    own = own_copy_events(State(), desired_of(State(meta_instances={MetaInstanceId("a"): MetaInstance.model_validate(
        meta("a"))})), copy(False, T0, "master"))
    state = applied(State(), own)
    assert state.desired_restored == copy(False, T0, "master")
    worse = {"savedAt": (T0 - timedelta(days=1)).isoformat(), "metaInstances": {"a": meta("a"), "b": meta("b"),
                                                                                  "bad": {"minNodes": 0}}}
    assert offer_events(state, offer(worse))[0] == [], "partial and older: nothing"
    better = {"savedAt": (T0 - timedelta(days=1)).isoformat(), "metaInstances": {"a": meta("a"), "c": meta("c")}}
    events, _ = offer_events(state, offer(better))
    assert [type(e) for e in events] == [MetaInstanceCreated, DesiredStateRestored], "only c: a is there"
    state = applied(state, events)
    assert sorted(state.meta_instances) == ["a", "c"]
    assert offer_events(state, offer(better, origin="third"))[0] == [], "the same rank again adds nothing"


def test_a_master_without_a_copy_restores_nothing_and_records_nothing() -> None:
    assert own_copy_events(State(), None, None) == []


def test_a_follower_keeps_its_good_file_until_the_cluster_restored_as_good_a_copy(tmp_path: Path) -> None:
    (tmp_path / "desired.json").write_text(json.dumps({"formatVersion": FORMAT_VERSION, "savedAt": T0.isoformat(),
                                                       "metaInstances": {"a": meta("a")}}))  # current: not migrated
    original = (tmp_path / "desired.json").read_text()
    keeper = DesiredStateFile(tmp_path)
    assert keeper.copy_of(NodeId("me")) == copy(True, T0, "me") and keeper.raw is not None
    empty = State(master_node_id=NodeId("m"))  # a master with no copy (or a corrupt one) restored nothing
    keeper._pending = empty
    keeper.flush()
    assert (tmp_path / "desired.json").read_text() == original, "not overwritten with less"
    restored = applied(empty, offer_events(empty, offer(keeper.raw))[0])
    keeper._pending = restored
    keeper.flush()
    assert (tmp_path / "desired.json").read_text() == original, "restored as it was: nothing new to write"
    keeper._pending = applied(restored, [MetaInstanceCreated(meta_instance=MetaInstance.model_validate(meta("b")))])
    keeper.flush()
    written = json.loads((tmp_path / "desired.json").read_text())
    assert list(written["metaInstances"]) == ["a", "b"] and datetime.fromisoformat(written["savedAt"]) > T0


def test_a_node_whose_file_was_garbage_holds_nothing_back(tmp_path: Path) -> None:
    (tmp_path / "desired.json").write_bytes(b"\x00\xffgarbage")
    keeper = DesiredStateFile(tmp_path)
    assert keeper.copy_of(NodeId("me")) is None and keeper.raw is None
    keeper._pending = State(master_node_id=NodeId("m"))
    keeper.flush()
    assert json.loads((tmp_path / "desired.json").read_text())["metaInstances"] == {}
