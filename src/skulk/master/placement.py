"""Placement: which nodes run a model, which layers each rank owns, and why a request cannot be placed.

Pure functions of `State`: no I/O, clocks or randomness (ids and the rendezvous port come in), so the API
can plan against the same state the master holds and both reach the same answer. Memory is checked per
node, never summed: a cluster whose total is enough can still refuse a model when one node's share does
not fit, which is what actually happens at load time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from skulk.config import DEFAULT_DATA_PORTS, parse_port_range
from skulk.engines.footprint import SHARD_SLACK
from skulk.master.balance import speed_costs
from skulk.master.cycles import (
    MAX_CYCLE_NODES,
    Adjacency,
    Ring,
    adjacency,
    largest_ring_size,
    live_nodes,
    rendezvous_host,
    rings_of_size,
)
from skulk.master.engine_choice import choose_kv_engines
from skulk.master.memory_pool import usable_bytes
from skulk.master.shard_plan import (
    NodePlan,
    admitted_context,
    allocate_layers,
    explicit_pool_tokens,
    kv_headroom_bytes,
    layer_ranges,
    plan_ring,
)
from skulk.master.speed import step_s_per_gb
from skulk.models.cards import with_kv_bits
from skulk.state.queries import card_of
from skulk.types.backends import EngineChoice, EngineName
from skulk.types.ids import InstanceId, NodeId, RunnerId
from skulk.types.instances import (
    InstanceMeta,
    MlxRingInstance,
    Rendezvous,
    ShardAssignments,
    Sharding,
)
from skulk.types.memory import GB, Memory
from skulk.types.models import ModelCard
from skulk.types.node_info import rank_role
from skulk.types.placement import (
    AllCandidatesExcluded,
    AnyPlacementError,
    InfoPending,
    InstanceKindUnsupported,
    InsufficientMemory,
    KvPoolTooSmall,
    KvSizing,
    NoConnectedCycle,
    NotEnoughLayers,
    PlacementError,
    PlacementPreview,
    PreviewNode,
    SingleNodeOnly,
    TensorNotSupported,
    TensorRefusal,
)
from skulk.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata
from skulk.types.state import State

__all__ = [
    "allocate_layers",
    "kv_headroom_bytes",
    "layer_ranges",
    "place",
    "preview_placements",
]
"""Re-exported so callers need only this module; the error and preview types live in skulk.types.placement."""


RENDEZVOUS_PORTS = parse_port_range(DEFAULT_DATA_PORTS)
"""Where a group's rendezvous listens unless the node says otherwise (Settings.data_ports): the master draws
from its node's range; the API's vetting plan and previews, whose ports are never bound, from this one."""


def new_rendezvous_port(ports: range = RENDEZVOUS_PORTS, used: Iterable[int] = (), span: int = 1) -> int:
    """A port p of `ports` with p .. p+span-1 inside them (an MLX ring's rank r listens on p + r; torch's group
    only on p), none held by a placed instance where such a p is left (a narrow range fills up, and two
    instances with the same rank-0 node and port could not both form), else any p that fits."""
    taken = set(used)
    starts = ports[: max(len(ports) - span + 1, 1)]
    free = [p for p in starts if taken.isdisjoint(range(p, p + span))] if taken else starts
    return random.choice(free or starts)


def rendezvous_ports(state: State) -> set[int]:
    """The ports the placed instances' rendezvous may hold: the port, and port + rank for an MLX ring."""
    return {port for i in state.instances.values() if i.rendezvous is not None
            for port in range(i.rendezvous.port, i.rendezvous.port + len(i.shard_assignments.node_to_runner))}


# ------------------------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class _Kv:
    """A placement's KV sizing resolved against the card: what the instance admits and its pool, if explicit."""

    context: int
    pool_bytes: int | None

    @classmethod
    def of(cls, card: ModelCard, sizing: KvSizing) -> _Kv:
        gb = sizing.kv_cache_gb if sizing.kv_cache_gb is not None else card.kv_cache_gb
        return cls(admitted_context(card, sizing.max_context), None if gb is None else int(gb * GB))

    def error(self, card: ModelCard, engine: EngineName | None = None) -> KvPoolTooSmall | None:
        """An explicit pool must hold one request of the whole context, or such a request could never run; on
        the ring's engine once chosen (the torch engine caches DeepSeek V3's MLA wider than the card's latent)."""
        if self.pool_bytes is None or card.embeds:
            return None
        tokens = explicit_pool_tokens(card, self.pool_bytes, engine)
        if tokens >= self.context:
            return None
        return KvPoolTooSmall(model_id=card.model_id, kv_cache_gb=self.pool_bytes / GB, pool_tokens=tokens,
                              context_length=self.context,
                              least=Memory.from_bytes(kv_headroom_bytes(card, card.n_layers, context=self.context,
                                                                        engine=engine)))


@dataclass(frozen=True)
class _Candidate:
    """A ring with its per-rank plan, or the reason it cannot host the model."""

    ring: Ring
    plans: tuple[NodePlan, ...] = ()
    error: AnyPlacementError | None = None
    engines: tuple[EngineName, ...] = ()
    """Each rank's engine, in ring order (more than one: a mixed Pipeline)."""

    @property
    def engine(self) -> EngineName:
        """The instance's engine: every rank's, or for a mixed one the wire its ranks speak (torch's)."""
        return self.engines[0] if len(set(self.engines)) == 1 else "torch"

    @property
    def engine_by_node(self) -> dict[NodeId, EngineName] | None:
        return dict(zip(self.ring, self.engines, strict=True)) if len(set(self.engines)) > 1 else None

    @property
    def headroom(self) -> int:
        return sum(p.left_after for p in self.plans)

    @property
    def worst_margin(self) -> int:
        return min((p.left_after for p in self.plans), default=0)

    @property
    def ids_key(self) -> tuple[NodeId, ...]:
        return tuple(sorted(self.ring))


def _kind_or_model_error(
    card: ModelCard, sharding: Sharding, meta: InstanceMeta, kv: _Kv
) -> AnyPlacementError | None:
    """Refusals that hold for every candidate, checked before looking at the topology."""
    if meta != InstanceMeta.MlxRing:
        return InstanceKindUnsupported(instance_meta=meta)
    if sharding == Sharding.Tensor and not card.supports_tensor:
        return _tensor_error(card, "model_unsupported", None)
    return kv.error(card)


def _tensor_error(card: ModelCard, reason: TensorRefusal, node_count: int | None) -> TensorNotSupported:
    return TensorNotSupported(
        reason=reason,
        model_id=card.model_id,
        node_count=node_count,
        num_attention_heads=card.num_attention_heads,
        num_key_value_heads=card.num_key_value_heads,
    )


def _shape_error(card: ModelCard, sharding: Sharding, size: int) -> AnyPlacementError | None:
    """Whether the model can be cut into `size` shards at all, before any memory is known."""
    if card.embeds and size > 1:
        return SingleNodeOnly(model_id=card.model_id, node_count=size)
    if sharding == Sharding.Pipeline:
        if card.n_layers < size:
            return NotEnoughLayers(model_id=card.model_id, n_layers=card.n_layers, node_count=size)
        return None
    if card.num_attention_heads % size:
        return _tensor_error(card, "attention_heads_not_divisible", size)
    if card.num_key_value_heads % size:
        return _tensor_error(card, "kv_heads_not_divisible", size)
    return None


def _insufficient(state: State, sharding: Sharding, ring: Ring, plan: NodePlan) -> InsufficientMemory:
    """Name the node the way the operator knows it, with the numbers that refused it."""
    identity = state.node_identities.get(plan.node_id)
    name = identity.friendly_name if identity and identity.friendly_name != "Unknown" else None
    memory = state.node_memory.get(plan.node_id)
    return InsufficientMemory(
        limit=memory.ram_total if memory is not None else None,
        limit_source=memory.limit_source if memory is not None else None,
        node_id=plan.node_id,
        node_name=name,
        node_ids=list(ring),
        sharding=sharding,
        needed=Memory.from_bytes(plan.needed),
        weights_share=Memory.from_bytes(plan.weights_share),
        overhead_factor=1.0 if plan.exact else SHARD_SLACK,
        runtime_overhead=Memory.from_bytes(plan.runtime_bytes),
        kv_pool=Memory.from_bytes(plan.kv_pool),
        available=Memory.from_bytes(plan.free),
        draft=Memory.from_bytes(plan.draft) if plan.draft else None,
    )


def _node_names(state: State) -> dict[NodeId, str]:
    return {n: i.friendly_name for n, i in state.node_identities.items() if i.friendly_name != "Unknown"}


def _evaluate(
    state: State, card: ModelCard, sharding: Sharding, ring: Ring, engine: EngineChoice, kv: _Kv
) -> _Candidate:
    """Plan one ring; unknown memory is InfoPending, never a false InsufficientMemory."""
    shape = _shape_error(card, sharding, len(ring))
    if shape is not None:
        return _Candidate(ring, error=shape)
    chosen = choose_kv_engines(card, engine, ring, state.node_backends, _node_names(state), sharding)
    if not isinstance(chosen, tuple):
        return _Candidate(ring, error=chosen)
    small = kv.error(card, chosen[0]) if len(set(chosen)) == 1 else None
    if small is not None:
        return _Candidate(ring, error=small)
    pending = [n for n in ring if n not in state.node_memory]
    if pending:
        return _Candidate(ring, error=InfoPending(node_ids=pending))
    on_device = card.torch_runtime != "transformers"  # the transformers fallback computes on the CPU
    free = [usable_bytes(state, n, e if on_device else None)  # GTT on UMA, VRAM for a torch rank on CUDA
            for n, e in zip(ring, chosen, strict=True)]
    draft = draft_card(state, card)
    plans = plan_ring(card, sharding, ring, free, context=kv.context, kv_cache_bytes=kv.pool_bytes, engines=chosen,
                      draft=draft, costs=_node_costs(state, ring), runtimes=_runtimes(state, ring, chosen))
    short = [p for p in plans if not p.fits]
    if short:
        worst = min(short, key=lambda p: p.left_after)
        return _Candidate(ring, plans, _insufficient(state, sharding, ring, worst), chosen)
    return _Candidate(ring, plans, engines=chosen)


def _runtimes(state: State, ring: Ring, engines: Sequence[EngineName]) -> list[int | None]:
    """Each rank's runtime overhead as its node's runners of that engine and role measured it (None: not yet)."""
    return [m.runner_overhead(e, rank_role(i)) if (m := state.node_memory.get(n)) is not None else None
            for i, (n, e) in enumerate(zip(ring, engines, strict=True))]


def _node_costs(state: State, ring: Ring) -> list[int] | None:
    """Each ring node's decode cost per byte (balance.speed_costs, from the compute it measured serving single
    streams); None, and equal speeds, unless every node has a figure."""
    figures = [step_s_per_gb(c, 1) if (c := state.node_compute.get(n)) is not None else None for n in ring]
    return speed_costs(figures)


def draft_card(state: State, card: ModelCard) -> ModelCard | None:
    """The card of the model's draft model, when it names one the cluster knows (else nothing is counted: the
    runner then finds no files for it either, unless copied in by hand)."""
    if card.draft_model is None:
        return None
    return card_of(state, card.draft_model)


def _best_valid(valid: Sequence[_Candidate]) -> _Candidate:
    """Same node count here; most total headroom wins, then node ids, so the choice is reproducible."""
    return min(valid, key=lambda c: (-c.headroom, c.ids_key))


def _best_failure(failed: Sequence[_Candidate]) -> AnyPlacementError:
    """The most useful refusal: the nearest memory miss if any, else the smallest ring's reason."""
    memory = [c for c in failed if isinstance(c.error, InsufficientMemory)]
    if memory:
        best = min(memory, key=lambda c: (-c.worst_margin, len(c.ring), c.ids_key))
    else:
        best = min(failed, key=lambda c: (len(c.ring), c.ids_key))
    assert best.error is not None
    return best.error


# ------------------------------------------------------------------------------------------------ place


def _has_ring(nodes: Sequence[NodeId], adj: Adjacency, min_size: int) -> bool:
    """Whether any ring of at least `min_size` nodes exists (stops at the first found)."""
    sizes = range(min_size, min(len(nodes), MAX_CYCLE_NODES) + 1)
    return any(next(rings_of_size(nodes, adj, size), None) is not None for size in sizes)


def _no_candidate_error(
    state: State, nodes: list[NodeId], adj: Adjacency, excluded: set[NodeId], min_nodes: int
) -> PlacementError:
    """Tell apart "the topology has no such ring" from "the exclusions removed every such ring"."""
    everyone = live_nodes(state.topology, ())
    dropped = sorted(excluded & set(everyone))
    if dropped and _has_ring(everyone, adjacency(state.topology, everyone), min_nodes):
        return AllCandidatesExcluded(excluded_node_ids=dropped, min_nodes=min_nodes)
    return NoConnectedCycle(
        min_nodes=min_nodes,
        connected_nodes=largest_ring_size(nodes, adj, min_nodes),
        available_nodes=len(nodes),
        max_cycle_nodes=MAX_CYCLE_NODES,
    )


def _choose(
    state: State, card: ModelCard, sharding: Sharding, nodes: list[NodeId], adj: Adjacency, min_nodes: int,
    engine: EngineChoice, kv: _Kv,
) -> _Candidate | AnyPlacementError | None:
    """Smallest ring size first; the first size with a valid ring decides (None: no ring at all).

    A ring whose memory is unknown could win on node count once its info arrives, so at the first size
    where nothing is valid but something is pending, the answer is InfoPending rather than a larger ring
    or a false InsufficientMemory.
    """
    failed: list[_Candidate] = []
    for size in range(min_nodes, min(len(nodes), MAX_CYCLE_NODES) + 1):
        candidates = [_evaluate(state, card, sharding, ring, engine, kv) for ring in rings_of_size(nodes, adj, size)]
        valid = [c for c in candidates if c.error is None]
        if valid:
            return _best_valid(valid)
        pending = {n for c in candidates if isinstance(c.error, InfoPending) for n in c.error.node_ids}
        if pending:
            return InfoPending(node_ids=sorted(pending))
        failed.extend(candidates)
    return _best_failure(failed) if failed else None


def _build_instance(
    state: State,
    card: ModelCard,
    sharding: Sharding,
    chosen: _Candidate,
    instance_id: InstanceId,
    new_runner_id: Callable[[], RunnerId],
    rendezvous_port: int,
    context: int,
) -> MlxRingInstance:
    """One runner per rank in ring order; Tensor ranks own every layer, Pipeline ranks their slice."""
    shard_type = TensorShardMetadata if sharding == Sharding.Tensor else PipelineShardMetadata
    runner_to_shard: dict[RunnerId, ShardMetadata] = {}
    node_to_runner: dict[NodeId, RunnerId] = {}
    kv_cache_bytes: dict[RunnerId, int] = {}
    for rank, plan in enumerate(chosen.plans):
        runner_id = new_runner_id()
        if runner_id in runner_to_shard:
            raise ValueError(f"new_runner_id returned {runner_id} twice")
        runner_to_shard[runner_id] = shard_type(
            model_card=card,
            device_rank=rank,
            world_size=len(chosen.plans),
            start_layer=plan.start_layer,
            end_layer=plan.end_layer,
            n_layers=card.n_layers,
        )
        node_to_runner[plan.node_id] = runner_id
        kv_cache_bytes[runner_id] = plan.kv_pool
    return MlxRingInstance(
        instance_id=instance_id,
        shard_assignments=ShardAssignments(
            model_id=card.model_id, runner_to_shard=runner_to_shard, node_to_runner=node_to_runner
        ),
        sharding=sharding,
        engine=chosen.engine,
        engine_by_node=chosen.engine_by_node,
        rendezvous=Rendezvous(
            host=rendezvous_host(state.topology.connections, chosen.ring), port=rendezvous_port
        ),
        context_length=context,
        kv_cache_bytes={} if card.embeds else kv_cache_bytes,
    )


def place(
    state: State,
    card: ModelCard,
    sharding: Sharding,
    instance_meta: InstanceMeta,
    *,
    instance_id: InstanceId,
    new_runner_id: Callable[[], RunnerId],
    rendezvous_port: int,
    min_nodes: int = 1,
    excluded_nodes: Iterable[NodeId] = (),
    engine: EngineChoice = "auto",
    sizing: KvSizing = KvSizing(),  # noqa: B008 - frozen, never mutated
) -> MlxRingInstance | PlacementError:
    """Place `card` on the smallest ring of at least `min_nodes` nodes where every node fits its shard.

    Among valid rings of that size the one with the most total headroom wins, then the lowest node ids. A ring
    whose nodes cannot all run the engine (engine_choice.py) is refused with EngineUnavailable. `sizing` sets the
    instance's context and KV pool (shard_plan); each node must fit its weights and its rank's pool.
    Returns the instance to put in a CreateInstance command, or the typed reason it cannot be placed.
    sizing.kv_cache_bits (else the card's) goes on the card the instance runs: its pools are sized at those bits.
    """
    card = with_kv_bits(card, sizing.kv_cache_bits)
    kv = _Kv.of(card, sizing)
    refused = _kind_or_model_error(card, sharding, instance_meta, kv)
    if refused is not None:
        return refused
    min_nodes = max(1, min_nodes)
    excluded = set(excluded_nodes)
    nodes = live_nodes(state.topology, excluded)
    adj = adjacency(state.topology, nodes)
    chosen = _choose(state, card, sharding, nodes, adj, min_nodes, engine, kv)
    if chosen is None:
        return _no_candidate_error(state, nodes, adj, excluded, min_nodes)
    if not isinstance(chosen, _Candidate):
        return chosen
    return _build_instance(state, card, sharding, chosen, instance_id, new_runner_id, rendezvous_port, kv.context)


# ---------------------------------------------------------------------------------------------- preview


def _preview(card: ModelCard, sharding: Sharding, meta: InstanceMeta, cand: _Candidate, kv: _Kv) -> PlacementPreview:
    nodes = [
        PreviewNode(
            node_id=p.node_id,
            device_rank=rank,
            world_size=len(cand.plans),
            start_layer=p.start_layer,
            end_layer=p.end_layer,
            n_layers=card.n_layers,
            needed=Memory.from_bytes(p.needed),
            free=Memory.from_bytes(p.free),
            left_after=Memory.from_bytes(p.left_after),
            kv_pool=Memory.from_bytes(p.kv_pool),
            weights=Memory.from_bytes(p.weights_share),
            runtime=Memory.from_bytes(p.runtime_bytes),
            runtime_measured=p.runtime is not None,
            engine=(engine := cand.engines[cand.ring.index(p.node_id)]),
            modeling="transformers" if engine == "torch" and card.torch_runtime == "transformers" else "native",
        )
        for rank, p in enumerate(cand.plans)
    ]
    return PlacementPreview(
        model_id=card.model_id,
        sharding=sharding,
        instance_meta=meta,
        node_ids=list(cand.ring),
        nodes=nodes if cand.error is None else [],
        context_length=kv.context if cand.error is None else None,
        error=cand.error,
    )


def preview_placements(
    state: State,
    card: ModelCard,
    sharding: Sharding,
    instance_meta: InstanceMeta,
    excluded_nodes: Iterable[NodeId] = (),
    engine: EngineChoice = "auto",
    sizing: KvSizing = KvSizing(),  # noqa: B008 - frozen, never mutated
) -> list[PlacementPreview]:
    """Every ring of every size from one node up, with its per-node plan or its typed refusal.

    Ordered by ring size, then node ids. Rings are capped like placement (cycles.MAX_CYCLE_NODES).
    """
    card = with_kv_bits(card, sizing.kv_cache_bits)
    kv = _Kv.of(card, sizing)
    refused = _kind_or_model_error(card, sharding, instance_meta, kv)
    nodes = live_nodes(state.topology, excluded_nodes)
    adj = adjacency(state.topology, nodes)
    previews: list[PlacementPreview] = []
    for size in range(1, min(len(nodes), MAX_CYCLE_NODES) + 1):
        for ring in rings_of_size(nodes, adj, size):
            cand = _Candidate(ring, error=refused) if refused else _evaluate(state, card, sharding, ring, engine, kv)
            previews.append(_preview(card, sharding, instance_meta, cand, kv))
    return previews
