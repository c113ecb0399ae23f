"""Which engine a ring runs a model with: the node's advertised backend tags, the card's filter and preference,
and the request's `engine` (types/backends.py). Pure functions of their arguments, like placement.

Every rank of an instance runs the same engine here: `auto` takes, in order, the card's backend_preference,
then MLX when every node of the ring computes on Metal, then torch, then MLX; the first engine every node can
run (and the card allows) wins. A ring where none fits is refused with the node that lacks it and what to
install there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from skulk.types.backends import ENGINES, BackendTag, EngineChoice, EngineName, engine_of
from skulk.types.ids import NodeId
from skulk.types.models import ModelCard
from skulk.types.placement import EngineUnavailable

LEGACY_TAGS: list[BackendTag] = ["torch", "torch-cpu"]
"""What a node that advertises nothing runs: an older build, torch only."""


def node_tags(backends: Mapping[NodeId, list[BackendTag]], node: NodeId) -> list[BackendTag]:
    return backends.get(node, LEGACY_TAGS)


def runs(card: ModelCard, tags: Sequence[str], engine: EngineName) -> bool:
    """The node can run this card with this engine: it advertises a tag of the engine that the card allows."""
    allowed = card.compatible_backends
    return any(engine_of(t) == engine and (allowed is None or t in allowed) for t in tags)


def _order(card: ModelCard, choice: EngineChoice, ring_tags: Sequence[Sequence[str]]) -> list[EngineName]:
    if choice != "auto":
        return [choice]
    order: list[EngineName] = []
    for tag in card.backend_preference:
        engine = engine_of(tag)
        if engine is not None:
            order.append(engine)
    metal = bool(ring_tags) and all("mlx-metal" in tags for tags in ring_tags)
    order += ("mlx", "torch") if metal else ("torch", "mlx")
    order += ENGINES
    return list(dict.fromkeys(order))


def choose_engine(
    card: ModelCard,
    choice: EngineChoice,
    ring: Sequence[NodeId],
    backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None,
) -> EngineName | EngineUnavailable:
    """The engine every node of the ring runs the model with, or the refusal naming the first node that
    lacks the wanted engine (auto: the first engine in order)."""
    tags = [node_tags(backends, n) for n in ring]
    order = _order(card, choice, tags)
    for engine in order:
        if all(runs(card, t, engine) for t in tags):
            return engine
    wanted = order[0]
    node, have = next((n, t) for n, t in zip(ring, tags, strict=True) if not runs(card, t, wanted))
    return EngineUnavailable(
        node_id=node, node_name=(names or {}).get(node), engine=wanted, requested=choice, advertised=list(have),
        model_id=card.model_id, compatible_backends=card.compatible_backends,
    )


def instance_engine_error(
    card: ModelCard, engine: EngineName, nodes: Sequence[NodeId], backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None,
) -> EngineUnavailable | None:
    """An instance given whole (POST /instance) still never puts a rank on a node that lacks its engine."""
    chosen = choose_engine(card, engine, nodes, backends, names)
    return chosen if isinstance(chosen, EngineUnavailable) else None
