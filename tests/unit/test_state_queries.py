"""state/queries.card_of: the one card lookup the master and the API share."""

from __future__ import annotations

import pytest

from skulk.models.cards import all_cards
from skulk.state.queries import card_of
from skulk.types.events import ModelCardAdded
from skulk.types.state import State

from .factories import applied

pytestmark = pytest.mark.timeout(30)


def test_card_of_reads_the_catalog_then_the_cards_nodes_added() -> None:
    packaged = all_cards()[0]
    assert card_of(State(), packaged.model_id) == packaged
    added = packaged.model_copy(update={"model_id": "someone/added-at-run-time"})
    assert card_of(State(), added.model_id) is None
    assert card_of(applied(ModelCardAdded(card=added)), added.model_id) == added
