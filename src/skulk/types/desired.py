"""Which saved copy of the operator's desired state a restarted cluster restored from (state/desired_offer.py)."""

from __future__ import annotations

from datetime import datetime

from .base import CamelModel
from .ids import NodeId


class RestoredCopy(CamelModel):
    """One node's `<home>/desired.json` as the master judged it: `whole` when every entry validated (a file with
    a skipped entry ranks below any whole one), `saved_at` the time that node last wrote it (None: a file from
    before the field, oldest of all)."""

    source: NodeId
    whole: bool
    saved_at: datetime | None = None


def rank_of(copy: RestoredCopy | None) -> tuple[bool, bool, float]:
    """Sort key, best last: any copy beats none, a whole copy beats one with skipped entries, then the newer.
    The wall clock orders copies of different cluster lives (a node that was down while the operator changed
    things holds an older file); copies of one life differ by milliseconds and hold the same entries."""
    if copy is None:
        return (False, False, 0.0)
    return (True, copy.whole, copy.saved_at.timestamp() if copy.saved_at is not None else 0.0)
