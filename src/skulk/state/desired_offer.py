"""Whose saved desired state a restarted cluster restores: the best copy any node holds, whichever node is
elected first (issue 38).

Every node keeps `<home>/desired.json`. The first master of a cluster (started with no event applied) restores
its own copy at once; each follower then offers the master its own (OfferDesiredState), and the master restores
what is missing from an offer that ranks above the copy restored so far (types/desired.rank_of: any copy beats
none, a copy read whole beats one with skipped entries, then the newer by its `savedAt`). So a master with no
file or a corrupt one still brings back the operator's MetaInstances from a follower, and a follower never has
its good file overwritten with less (state/desired.DesiredStateFile holds it until then).

Offers count only while the cluster's start is fresh: within OFFER_WINDOW_S of the first master's term, and
before any MetaInstance was deleted in it (an offer must not bring back what the operator just removed). What
an offer adds is only what the state lacks; nothing restored is taken away.
"""

from __future__ import annotations

from skulk.state.desired import DesiredState, parse_desired_object, restore_events, saved_at_of
from skulk.types.commands import OfferDesiredState
from skulk.types.desired import RestoredCopy, rank_of
from skulk.types.events import DesiredStateRestored, Event, MetaInstanceCreated, ModelCardAdded
from skulk.types.state import State

OFFER_WINDOW_S = 30.0
"""How long after a restarted cluster's first term began its master takes offers: long enough for nodes started
one after the other by hand, short enough that a node joining much later cannot rewrite the cluster's intent."""


def own_copy_events(state: State, desired: DesiredState | None, copy: RestoredCopy | None) -> list[Event]:
    """The first master's own copy, restored at its start (pure); nothing when it has none."""
    if desired is None or copy is None:
        return []
    return [*restore_events(state, desired), DesiredStateRestored(restored=copy)]


def offer_events(state: State, offer: OfferDesiredState) -> tuple[list[Event], str]:
    """What a follower's offered copy adds (pure), and a few words on why, for the log. The copy is validated
    entry by entry exactly as a node's own file (a bad entry skipped, so the copy ranks as partial); it is
    restored only if it ranks above what the cluster restored so far, and then only what the state lacks."""
    desired, skipped = parse_desired_object(offer.saved)
    if desired is None:
        return [], "not a desired state"
    copy = RestoredCopy(source=offer.origin, whole=not skipped, saved_at=saved_at_of(offer.saved))
    restored = state.desired_restored
    if rank_of(copy) <= rank_of(restored):
        return [], f"it ranks no higher than the copy restored from {restored.source[:8] if restored else '-'}"
    events = restore_events(state, desired)
    metas = sum(isinstance(e, MetaInstanceCreated) for e in events)
    cards = sum(isinstance(e, ModelCardAdded) for e in events)
    quality = "whole" if copy.whole else f"{len(skipped)} entries skipped"
    return [*events, DesiredStateRestored(restored=copy)], f"restored ({quality}): {metas} MetaInstances, {cards} cards"
