"""Which engine a ring runs a model with: the node's advertised backend tags, the card's filter and preference,
and the request's `engine` (types/backends.py). Pure functions of their arguments, like placement.

`auto` gives each node its best engine: the card's backend_preference, then MLX on Metal or where torch would run
the family only through transformers' modeling (its fallback), then torch, then MLX;
the first the node can run and the card allows (a family only mlx-lm runs is carded MLX-only: models/families.py).
Where the nodes of a Pipeline ring differ, the instance is mixed (`choose_engines`): each rank runs its node's
engine and every rank speaks the torch engine's group wire (engines/mlx/mixed.py). Otherwise every rank runs one
engine: for `auto` the first in that order (MLX first only when every node computes on Metal) that every node can
run. A ring where none fits is refused with the node that lacks it and what to install there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from skulk.models.families import uniform_layers
from skulk.types.backends import ENGINES, BackendTag, EngineChoice, EngineName, allows, engine_of
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.models import ModelCard
from skulk.types.placement import EngineUnavailable

LEGACY_TAGS: list[BackendTag] = ["torch", "torch-cpu"]
"""What a node that advertises nothing runs: an older build, torch only."""


def mlx_splits(card: ModelCard, sharding: Sharding | None, ranks: int) -> bool:
    """mlx-lm can run the card's family over this many ranks with this sharding: what the card read from
    mlx-lm's module (ModelCard.mlx_splits); a card that read nothing, Pipeline where every layer is alike."""
    if ranks == 1 or sharding is None:
        return True
    if card.mlx_splits is not None:
        return sharding.value in card.mlx_splits
    kinds = [layer.kind for layer in card.memory.layers] if card.memory else None
    return sharding == Sharding.Pipeline and uniform_layers(kinds, card.n_layers, card.sliding_layers)


def torch_splits(card: ModelCard, ranks: int, sharding: Sharding | None = None) -> bool:
    """The torch engine can run the card's family over this many ranks: any number, either sharding, where it
    runs the family natively; through transformers' modeling (ModelCard.torch_runtime), as a Pipeline where the
    card says that splits (ModelCard.fallback_splits), never as Tensor."""
    if ranks == 1 or card.torch_runtime == "native":
        return True
    return sharding != Sharding.Tensor and bool(card.fallback_splits)


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
    mlx_first = metal or card.torch_runtime == "transformers"  # mlx-lm's own model beats the slow fallback
    order += ("mlx", "torch") if mlx_first else ("torch", "mlx")
    order += ENGINES
    allowed: list[EngineName] = [e for e in order if allows(card.compatible_backends, e)]
    return list(dict.fromkeys(allowed + order))  # a refusal names an engine the card allows


def choose_engine(
    card: ModelCard,
    choice: EngineChoice,
    ring: Sequence[NodeId],
    backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None,
    sharding: Sharding | None = None,
) -> EngineName | EngineUnavailable:
    """The engine every node of the ring runs the model with, or the refusal naming the first node that
    lacks the wanted engine (auto: the first engine in order)."""
    tags = [node_tags(backends, n) for n in ring]
    order = _order(card, choice, tags)
    splits: dict[EngineName, bool] = {"mlx": mlx_splits(card, sharding, len(ring)),
                                      "torch": torch_splits(card, len(ring), sharding)}
    for engine in order:
        if all(runs(card, t, engine) for t in tags) and splits[engine]:
            return engine
    fits: list[EngineName] = [e for e in order if all(runs(card, t, e) for t in tags)]  # then a split fails
    wanted = fits[0] if fits else order[0]
    node, have = next(((n, t) for n, t in zip(ring, tags, strict=True) if not runs(card, t, wanted)),
                      (ring[0], tags[0]))
    detail = None
    if all(runs(card, t, wanted) for t in tags):
        detail = _split_refusal(card, wanted, sharding, len(ring))
    return EngineUnavailable(
        node_id=node, node_name=(names or {}).get(node), engine=wanted, requested=choice, advertised=list(have),
        model_id=card.model_id, compatible_backends=card.compatible_backends, detail=detail,
    )


def _split_refusal(card: ModelCard, engine: EngineName, sharding: Sharding | None, ranks: int) -> str:
    """Why this engine, which the ring's nodes have, cannot split the model over them."""
    how = "Tensor" if sharding == Sharding.Tensor else "Pipeline"
    if engine == "torch":
        return (f"the torch engine runs {card.model_id} ({card.family}) through transformers' modeling, which "
                f"{_why_fallback_not_split(card, how)} ({ranks} ranks asked); place it "
                f"{'with sharding Pipeline, ' if how == 'Tensor' and card.fallback_splits else ''}on one node "
                "(min_nodes 1), or with engine mlx on nodes that have it.")
    return (f"mlx-lm cannot split model {card.model_id} ({card.family}) {how} over {ranks} ranks "
            f"({_why_not_split(card, how)}); place it on one node, with the other sharding, or with engine torch.")


def _why_fallback_not_split(card: ModelCard, how: str) -> str:
    if how == "Tensor":
        return "splits by layers (Pipeline), not Tensor"
    if card.fallback_splits is None:
        return "this card predates splitting it (add the model again)"
    return ("cannot split this family: its layers read the token ids beside the hidden states (per-layer "
            "inputs) or another layer's cache (shared keys and values)")


def _why_not_split(card: ModelCard, how: str) -> str:
    if card.mlx_splits is None:
        return "its card predates this build's reading of mlx-lm's modules: add the model again"
    if how == "Tensor":
        return "its mlx-lm model has no shard()"
    return ("its layers differ in kind and its mlx-lm model indexes them by position, so a slice of them would "
            "mis-mask or mis-cache")


def mixable(card: ModelCard, sharding: Sharding | None, ranks: int) -> bool:
    """Ranks of different engines can share this instance: a Pipeline (hidden states cross between ranks; a
    Tensor rank's all_reduce inside every layer would need both engines' kernels in lockstep) of a family
    mlx-lm can slice and the torch engine runs natively: the mixed wire is TorchEngine's group wire, which the
    transformers fallback's ranks (engines/torch/fallback.py, headers and sampler rows of their own) do not speak."""
    return (ranks > 1 and sharding == Sharding.Pipeline and card.torch_runtime == "native"
            and mlx_splits(card, sharding, ranks) and torch_splits(card, ranks))


def choose_engines(
    card: ModelCard,
    choice: EngineChoice,
    ring: Sequence[NodeId],
    backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None,
    sharding: Sharding | None = None,
) -> tuple[EngineName, ...] | EngineUnavailable:
    """Each rank's engine in ring order. `auto` on a mixable ring gives each node its own best engine (a Mac's
    MLX beside a Linux box's torch); otherwise one engine for all (choose_engine) or its refusal."""
    if choice == "auto" and mixable(card, sharding, len(ring)):
        best: list[EngineName | None] = [next((e for e in _order(card, "auto", [t]) if runs(card, t, e)), None)
                                         for t in (node_tags(backends, n) for n in ring)]
        engines: tuple[EngineName, ...] = tuple(e for e in best if e is not None)
        if len(engines) == len(ring) and len(set(engines)) > 1:
            return engines
    chosen = choose_engine(card, choice, ring, backends, names, sharding)
    if isinstance(chosen, EngineUnavailable):
        return chosen
    every: list[EngineName] = [chosen] * len(ring)
    return tuple(every)


def instance_engine_error(
    card: ModelCard, engines: Mapping[NodeId, EngineName], backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None, sharding: Sharding | None = None,
) -> EngineUnavailable | None:
    """An instance given whole (POST /instance) still never puts a rank on a node that lacks its engine (each
    node its own, for a mixed one; a mixed Tensor instance is refused)."""
    if len(set(engines.values())) > 1 and not mixable(card, sharding, len(engines)):
        node = next(iter(engines))
        return EngineUnavailable(
            node_id=node, node_name=(names or {}).get(node), engine=engines[node], requested=engines[node],
            advertised=list(node_tags(backends, node)), model_id=card.model_id,
            compatible_backends=card.compatible_backends,
            detail=f"ranks of different engines share only a Pipeline of a family mlx-lm can slice and the torch "
                   f"engine runs natively, not this {sharding} instance of {card.model_id} ({card.family}, torch "
                   f"runtime {card.torch_runtime}); give every rank one engine.")
    if "torch" in engines.values() and not torch_splits(card, len(engines), sharding):
        node = next(n for n, e in engines.items() if e == "torch")
        return EngineUnavailable(
            node_id=node, node_name=(names or {}).get(node), engine="torch", requested="torch",
            advertised=list(node_tags(backends, node)), model_id=card.model_id,
            compatible_backends=card.compatible_backends,
            detail=_split_refusal(card, "torch", sharding, len(engines)))
    for node, engine in engines.items():
        chosen = choose_engine(card, engine, [node], backends, names, None)
        if isinstance(chosen, EngineUnavailable):
            return chosen
    return None


def choose_kv_engines(
    card: ModelCard,
    choice: EngineChoice,
    ring: Sequence[NodeId],
    backends: Mapping[NodeId, list[BackendTag]],
    names: Mapping[NodeId, str] | None = None,
    sharding: Sharding | None = None,
) -> tuple[EngineName, ...] | EngineUnavailable:
    """choose_engines for a card whose KV cache is quantized (kv_cache_bits 8 or 4), which only the torch engine
    stores: `auto` then takes torch where every node has it, and a ring that would put an MLX rank in is refused
    with a message that names the engine and the way out."""
    chosen = choose_engines(card, choice, ring, backends, names, sharding)
    bits = card.kv_cache_bits or 16
    if bits == 16 or not isinstance(chosen, tuple) or "mlx" not in chosen:
        return chosen
    if choice == "auto":
        on_torch = choose_engines(card, "torch", ring, backends, names, sharding)
        if isinstance(on_torch, tuple):
            return on_torch
    node = ring[chosen.index("mlx")]
    return EngineUnavailable(
        node_id=node, node_name=(names or {}).get(node), engine="mlx", requested=choice,
        advertised=list(node_tags(backends, node)), model_id=card.model_id,
        compatible_backends=card.compatible_backends,
        detail=f"kv_cache_bits {bits}: the mlx engine keeps its KV cache in 16 bits, and node {node} would run "
               f"{card.model_id} on mlx; place with kv_cache_bits 16, or with engine torch on nodes that have it.")
