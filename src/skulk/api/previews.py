"""Placement previews in Skulk's wire shape, built from the placement module's per-ring previews."""

from __future__ import annotations

from collections.abc import Iterable

from skulk.master.placement import new_rendezvous_port, place, preview_placements
from skulk.master.speed import RankShare, SpeedPrediction, predict_speed
from skulk.types.backends import EngineChoice
from skulk.types.ids import InstanceId, NodeId, RunnerId, new_id
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.models import ModelCard
from skulk.types.placement import KvSizing, PlacementPreview
from skulk.types.previews import SkulkPlacementPreview
from skulk.types.state import State


def _instance_on_ring(
    state: State, card: ModelCard, preview: PlacementPreview, engine: EngineChoice, sizing: KvSizing
) -> MlxRingInstance | None:
    """The instance placement builds on exactly this ring (every other node excluded), with fresh ids (its
    rendezvous port is never bound: a preview is not placed)."""
    others = set(state.topology.nodes) - set(preview.node_ids)
    placed = place(
        state, card, preview.sharding, preview.instance_meta,
        instance_id=InstanceId(new_id()), new_runner_id=lambda: RunnerId(new_id()),
        rendezvous_port=new_rendezvous_port(), min_nodes=len(preview.node_ids), excluded_nodes=others,
        engine=engine, sizing=sizing,
    )
    return placed if isinstance(placed, MlxRingInstance) else None


def _prediction(state: State, card: ModelCard, preview: PlacementPreview) -> SpeedPrediction | None:
    ordered = sorted(preview.nodes, key=lambda n: n.device_rank)
    ranks = [RankShare(n.node_id, n.end_layer - n.start_layer) for n in ordered]
    return predict_speed(card, preview.sharding, ranks, state.node_compute, state.node_links)


def _to_skulk(
    state: State, card: ModelCard, preview: PlacementPreview, engine: EngineChoice, sizing: KvSizing
) -> SkulkPlacementPreview:
    instance = _instance_on_ring(state, card, preview, engine, sizing) if preview.error is None else None
    error = preview.error.message if preview.error is not None else None
    if preview.error is None and instance is None:
        error = "the ring could not be planned again; GET /instance/previews once more"
    speed = _prediction(state, card, preview) if instance is not None else None
    return SkulkPlacementPreview(
        model_id=card.model_id,
        sharding=preview.sharding,
        instance_meta=preview.instance_meta,
        instance=instance,
        memory_delta_by_node={n.node_id: n.needed.in_bytes for n in preview.nodes} if instance else None,
        engine_by_node={n.node_id: n.engine for n in preview.nodes} if instance else None,
        predicted_decode_tps=round(speed.decode_tps, 2) if speed else None,
        predicted_aggregate_tps=round(speed.aggregate_tps, 2) if speed and speed.aggregate_tps else None,
        predicted_batch=speed.batch if speed else None,
        kv_cache_bytes_by_node={n.node_id: n.kv_pool.in_bytes for n in preview.nodes} if instance else None,
        weights_bytes_by_node={n.node_id: n.weights.in_bytes for n in preview.nodes} if instance else None,
        runtime_bytes_by_node={n.node_id: n.runtime.in_bytes for n in preview.nodes} if instance else None,
        runtime_measured_by_node={n.node_id: n.runtime_measured for n in preview.nodes} if instance else None,
        context_length=preview.context_length if instance else None,
        error=error,
    )


def _node_count(preview: SkulkPlacementPreview) -> int:
    return len(preview.memory_delta_by_node or {})


def with_split_warnings(previews: list[SkulkPlacementPreview]) -> list[SkulkPlacementPreview]:
    """Mark each split predicted to decode one stream slower than the fastest placement on fewer nodes."""
    warned: list[SkulkPlacementPreview] = []
    for preview in previews:
        rate, nodes = preview.predicted_decode_tps, _node_count(preview)
        fewer = [p for p in previews if p.predicted_decode_tps is not None and 0 < _node_count(p) < nodes]
        best = max(fewer, key=lambda p: p.predicted_decode_tps or 0.0, default=None)
        if rate is not None and best is not None and best.predicted_decode_tps is not None \
                and best.predicted_decode_tps > rate:
            warning = (f"slower than fewer nodes: {nodes} nodes ({preview.sharding}) are predicted to decode "
                       f"{rate:.1f} tok/s, {_node_count(best)} node(s) ({best.sharding}) "
                       f"{best.predicted_decode_tps:.1f} tok/s")
            preview = preview.model_copy(update={"predicted_warning": warning})
        warned.append(preview)
    return warned


def skulk_previews(
    state: State,
    card: ModelCard,
    shardings: Iterable[Sharding],
    metas: Iterable[InstanceMeta],
    excluded: set[NodeId],
    engine: EngineChoice = "auto",
    sizing: KvSizing = KvSizing(),  # noqa: B008 - frozen, never mutated
) -> list[SkulkPlacementPreview]:
    """Every ring that can host the model, with its instance; one entry per distinct refusal otherwise."""
    found: list[SkulkPlacementPreview] = []
    refusals: set[tuple[Sharding, InstanceMeta, str]] = set()
    for meta in metas:
        for sharding in shardings:
            for preview in preview_placements(state, card, sharding, meta, excluded, engine, sizing):
                entry = _to_skulk(state, card, preview, engine, sizing)
                if entry.error is not None:
                    key = (sharding, meta, entry.error)
                    if key in refusals:
                        continue
                    refusals.add(key)
                found.append(entry)
    return with_split_warnings(found)
