"""The master's reconcilers (seed 003), as pure functions of state: each returns the events that move the
cluster toward what its MetaInstances declare. The master runs them every second, in order, applying each
one's events before the next runs: instance health first (a broken instance goes before anything is placed),
then lost nodes, then placement of unsatisfied MetaInstances.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from skulk.master.decide import fail_open_tasks, named_failures
from skulk.master.placement import draft_card, new_rendezvous_port, place
from skulk.master.shard_plan import draft_committed, loaded_bytes
from skulk.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceRetrying,
    MetaInstancePlacementFailed,
)
from skulk.types.ids import InstanceId, MetaInstanceId, ModelId, NodeId, RunnerId, new_id
from skulk.types.instances import MlxRingInstance
from skulk.types.memory import Memory
from skulk.types.meta_instances import MAX_INSTANCE_RETRIES, MetaInstance

__all__ = ["MAX_INSTANCE_RETRIES", "Ids", "instance_health", "unsatisfied", "unsatisfied_placements"]
from skulk.types.models import ModelCard
from skulk.types.placement import InfoPending, NoConnectedCycle, PlacementError
from skulk.types.runners import RunnerFailed, RunnerLoaded, RunnerReady, RunnerRunning, RunnerShutdown
from skulk.types.state import State

CONNECTION_LOST = "Network connection lost"
LOADED = (RunnerLoaded, RunnerReady, RunnerRunning)


@dataclass(frozen=True)
class Ids:
    """Where new ids come from: random in the master, fixed in tests."""

    instance: Callable[[], InstanceId] = lambda: InstanceId(new_id())
    runner: Callable[[], RunnerId] = lambda: RunnerId(new_id())
    port: Callable[[], int] = new_rendezvous_port


# ------------------------------------------------------------------------------------------ matching


def nodes_of(instance: MlxRingInstance) -> set[NodeId]:
    return set(instance.shard_assignments.node_to_runner)


def matches(meta: MetaInstance, instance: MlxRingInstance) -> bool:
    """The instance satisfies the constraint: same model, sharding and kind, enough nodes, on allowed nodes."""
    return (
        instance.model_id == meta.model_id
        and instance.sharding == meta.sharding
        and (meta.engine == "auto" or (meta.engine == instance.engine and not instance.mixed))
        and instance.world_size >= meta.min_nodes
        and (meta.node_ids is None or nodes_of(instance) <= set(meta.node_ids))
    )


def connections_healthy(state: State, instance: MlxRingInstance) -> bool:
    """Every node of the instance is in the topology, each pair of neighbouring ranks is still linked (in
    either direction: one failed probe removes one direction only), and the rendezvous IP edge still exists."""
    alive = set(state.topology.nodes)
    ranks = sorted(instance.shard_assignments.node_to_runner.items(),
                   key=lambda item: instance.shard_assignments.runner_to_shard[item[1]].device_rank)
    nodes = [node for node, _ in ranks]
    if not set(nodes) <= alive:
        return False
    links = {(c.source, c.sink) for c in state.topology.connections}
    linked = all((a, b) in links or (b, a) in links for a, b in itertools.pairwise(nodes))
    return linked and rendezvous_edge_alive(state, instance, nodes)


def rendezvous_edge_alive(state: State, instance: MlxRingInstance, ranks: list[NodeId]) -> bool:
    """Health is per IP edge, not per node pair (seed 003): the address the ranks were told to meet rank 0 at
    must still be an edge into rank 0. When cables are swapped or an interface changes, the pair stays linked
    over another address, but the ranks would dial the dead one; the instance is re-created on the new edge."""
    if len(ranks) < 2 or instance.rendezvous is None:
        return True
    host = instance.rendezvous.host
    return any(c.sink == ranks[0] and c.sink_address == host for c in state.topology.connections)


def runners_failed(state: State, instance: MlxRingInstance) -> str | None:
    """The joined, node-named errors when every runner is terminal and at least one failed; None otherwise (a
    runner with no status yet is still starting)."""
    statuses = [state.runners.get(r) for r in instance.shard_assignments.runner_to_shard]
    if any(s is None or not isinstance(s, RunnerFailed | RunnerShutdown) for s in statuses):
        return None
    return "; ".join(named_failures(state, instance)) or None


def backing(state: State, meta: MetaInstance) -> list[MlxRingInstance]:
    return [i for i in state.instances.values() if i.meta_instance_id == meta.meta_instance_id]


def unsatisfied(state: State) -> list[MetaInstance]:
    """MetaInstances without a bound instance that matches and whose connections hold."""
    return [
        meta
        for meta in sorted(state.meta_instances.values(), key=lambda m: m.meta_instance_id)
        if not any(matches(meta, i) and connections_healthy(state, i) for i in backing(state, meta))
    ]


# ------------------------------------------------------------------------------------- instance health


def instance_health(state: State) -> list[Event]:
    """Bound instances only (directly placed ones follow the restart budget of decide): a broken link deletes
    the instance; failed runners retry it in place up to MAX_INSTANCE_RETRIES, then delete it so the
    MetaInstance places a new one."""
    events: list[Event] = []
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        meta = state.meta_instances.get(instance.meta_instance_id) if instance.meta_instance_id else None
        if meta is None:
            continue
        iid = instance.instance_id
        if not connections_healthy(state, instance):
            events += fail_open_tasks(state, {iid}, "the instance lost a network connection")
            events.append(InstanceDeleted(instance_id=iid, failure_error=CONNECTION_LOST))
            continue
        error = runners_failed(state, instance)
        if error is None:
            continue
        events += fail_open_tasks(state, {iid}, f"the instance failed ({error})")
        if meta.consecutive_failures < MAX_INSTANCE_RETRIES:
            events.append(InstanceRetrying(instance_id=iid, meta_instance_id=meta.meta_instance_id,
                                           failure_error=error))
        else:
            events.append(InstanceDeleted(instance_id=iid, failure_error=error))
    return events


# ---------------------------------------------------------------------------------------- placement


def with_committed(state: State) -> State:
    """The state placement should see: each node's free memory less what is committed to it and not yet in its
    reading: the weights of shards whose runners have not loaded yet (a loaded runner's weights are in the node's
    reported memory), and every rank's KV pool (its pages are committed only as blocks are first used, so a
    reading never shows the whole pool). Without this, two placements in quick succession both see the same free
    memory and double-book the node."""
    memory = dict(state.node_memory)
    for instance in state.instances.values():
        engines = instance.engines()
        for node, runner in instance.shard_assignments.node_to_runner.items():
            usage = memory.get(node)
            if usage is None:
                continue
            pool = instance.kv_cache_bytes.get(runner, 0) + _draft(state, instance, node, runner)
            if isinstance(state.runners.get(runner), LOADED):
                left = max(0, usage.ram_available.in_bytes - pool)
                memory[node] = usage.model_copy(update={"ram_available": Memory.from_bytes(left)})
                continue
            shard = instance.shard_assignments.runner_to_shard[runner]
            card = shard.model_card
            weights = loaded_bytes(card, engines[node])
            share = weights * (shard.end_layer - shard.start_layer) // max(1, card.n_layers)
            if instance.sharding.value == "Tensor":
                share = weights // max(1, shard.world_size)
            left = max(0, usage.ram_available.in_bytes - share - pool)
            memory[node] = usage.model_copy(update={"ram_available": Memory.from_bytes(left)})
    return state.model_copy(update={"node_memory": memory})


def _draft(state: State, instance: MlxRingInstance, node: NodeId, runner: RunnerId) -> int:
    """The draft model's commitment on a single torch rank whose card names one the cluster knows (else 0)."""
    shard = instance.shard_assignments.runner_to_shard[runner]
    draft = draft_card(state, shard.model_card)
    if draft is None or shard.world_size != 1 or instance.engines()[node] != "torch":
        return 0
    return draft_committed(draft, instance.kv_cache_bytes.get(runner, 0), shard.model_card,
                           isinstance(state.runners.get(runner), LOADED))


def place_for(state: State, meta: MetaInstance, card: ModelCard, ids: Ids) -> MlxRingInstance | PlacementError:
    """Place against committed memory; pinned node_ids count only while alive, so a dead pinned node does
    not block re-placement on the others."""
    excluded: set[NodeId] = set()
    if meta.node_ids is not None:
        allowed = set(meta.node_ids) & set(state.topology.nodes)
        excluded = set(state.topology.nodes) - allowed
    outcome = place(
        with_committed(state),
        card,
        meta.sharding,
        meta.instance_meta,
        instance_id=ids.instance(),
        new_runner_id=ids.runner,
        rendezvous_port=ids.port(),
        min_nodes=meta.min_nodes,
        excluded_nodes=excluded,
        engine=meta.engine,
        sizing=meta.sizing,
    )
    if isinstance(outcome, PlacementError):
        return outcome
    return outcome.model_copy(update={"meta_instance_id": meta.meta_instance_id})


def not_yet(outcome: PlacementError | str) -> bool:
    """An outcome that only says the nodes have not reported yet (no node known, or memory info arriving)."""
    no_nodes = isinstance(outcome, NoConnectedCycle) and outcome.available_nodes == 0
    return no_nodes or isinstance(outcome, InfoPending)


def placement_events(
    state: State,
    metas: Iterable[MetaInstance],
    card_of: Callable[[ModelId], ModelCard | None],
    ids: Ids,
) -> list[Event]:
    """One placement per unsatisfied MetaInstance, each against the instances placed before it in the same
    pass; a failure is recorded only when its reason changed (no event storm every second)."""
    events: list[Event] = []
    for meta in metas:
        card = card_of(meta.model_id)
        if card is None:
            outcome: MlxRingInstance | PlacementError | str = f"unknown model {meta.model_id}"
        else:
            outcome = place_for(state, meta, card, ids)
        if isinstance(outcome, MlxRingInstance):
            events.append(InstanceCreated(instance=outcome))
            state = state.model_copy(update={"instances": {**state.instances, outcome.instance_id: outcome}})
            continue
        if not_yet(outcome):
            continue  # the cluster is still gathering: placing, not an error (no WARNING a second before it places)
        reason = outcome if isinstance(outcome, str) else outcome.message
        if reason != meta.placement_error:
            events.append(MetaInstancePlacementFailed(meta_instance_id=meta.meta_instance_id, reason=reason))
    return events


def first_placement(
    state: State, meta: MetaInstance, nodes: list[NodeId], card_of: Callable[[ModelId], ModelCard | None], ids: Ids
) -> list[Event]:
    """The first instance on exactly `nodes` (a preview the operator launched), or [] when it does not fit
    there any more (the MetaInstance is then placed by its own constraint). Never outside meta.node_ids."""
    if meta.meta_instance_id not in state.meta_instances or any(i.meta_instance_id == meta.meta_instance_id
                                                                 for i in state.instances.values()):
        return []
    if meta.node_ids is not None and not set(nodes) <= set(meta.node_ids):
        return []
    exact = meta.model_copy(update={"node_ids": nodes, "min_nodes": max(meta.min_nodes, len(set(nodes)))})
    events = placement_events(state, [exact], card_of, ids)
    return [e for e in events if isinstance(e, InstanceCreated) and nodes_of(e.instance) == set(nodes)]


def unsatisfied_placements(
    state: State, card_of: Callable[[ModelId], ModelCard | None], ids: Ids, only: MetaInstanceId | None = None
) -> list[Event]:
    metas = [m for m in unsatisfied(state) if only is None or m.meta_instance_id == only]
    return placement_events(state, metas, card_of, ids)
