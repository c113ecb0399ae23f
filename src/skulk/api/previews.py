"""Placement previews in Skulk's wire shape, built from the placement module's per-ring previews."""

from __future__ import annotations

import random
from collections.abc import Iterable

from skulk.master.placement import place, preview_placements
from skulk.types.backends import EngineChoice
from skulk.types.ids import InstanceId, NodeId, RunnerId, new_id
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.models import ModelCard
from skulk.types.placement import PlacementPreview
from skulk.types.previews import SkulkPlacementPreview
from skulk.types.state import State


def _instance_on_ring(
    state: State, card: ModelCard, preview: PlacementPreview, engine: EngineChoice
) -> MlxRingInstance | None:
    """The instance placement builds on exactly this ring (every other node excluded), with fresh ids."""
    others = set(state.topology.nodes) - set(preview.node_ids)
    placed = place(
        state, card, preview.sharding, preview.instance_meta,
        instance_id=InstanceId(new_id()), new_runner_id=lambda: RunnerId(new_id()),
        rendezvous_port=random.randint(29500, 29999), min_nodes=len(preview.node_ids), excluded_nodes=others,
        engine=engine,
    )
    return placed if isinstance(placed, MlxRingInstance) else None


def _to_skulk(state: State, card: ModelCard, preview: PlacementPreview, engine: EngineChoice) -> SkulkPlacementPreview:
    instance = _instance_on_ring(state, card, preview, engine) if preview.error is None else None
    error = preview.error.message if preview.error is not None else None
    if preview.error is None and instance is None:
        error = "the ring could not be planned again; GET /instance/previews once more"
    return SkulkPlacementPreview(
        model_id=card.model_id,
        sharding=preview.sharding,
        instance_meta=preview.instance_meta,
        instance=instance,
        memory_delta_by_node={n.node_id: n.needed.in_bytes for n in preview.nodes} if instance else None,
        engine_by_node={n.node_id: n.engine for n in preview.nodes} if instance else None,
        error=error,
    )


def skulk_previews(
    state: State,
    card: ModelCard,
    shardings: Iterable[Sharding],
    metas: Iterable[InstanceMeta],
    excluded: set[NodeId],
    engine: EngineChoice = "auto",
) -> list[SkulkPlacementPreview]:
    """Every ring that can host the model, with its instance; one entry per distinct refusal otherwise."""
    found: list[SkulkPlacementPreview] = []
    refusals: set[tuple[Sharding, InstanceMeta, str]] = set()
    for meta in metas:
        for sharding in shardings:
            for preview in preview_placements(state, card, sharding, meta, excluded, engine):
                entry = _to_skulk(state, card, preview, engine)
                if entry.error is not None:
                    key = (sharding, meta, entry.error)
                    if key in refusals:
                        continue
                    refusals.add(key)
                found.append(entry)
    return found
