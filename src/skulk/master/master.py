"""The master shell: take commands and local events, decide with pure functions, emit ordered events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from skulk.cluster.dataplane import publish_chunk
from skulk.cluster.intake import Intake
from skulk.cluster.sync import Sequencer
from skulk.cluster.transport import Transport
from skulk.master import commands, reconcile
from skulk.master.decide import (
    RESTART_BUDGET,
    RESTART_WINDOW_S,
    events_for_command,
    events_for_lost_node,
    events_for_new_session,
    events_for_unhealthy_instances,
)
from skulk.master.placement import RENDEZVOUS_PORTS, new_rendezvous_port, rendezvous_ports
from skulk.state.apply import apply
from skulk.state.desired import DesiredState
from skulk.state.desired_offer import OFFER_WINDOW_S, offer_events, own_copy_events
from skulk.state.queries import card_of
from skulk.structured_log import log_context
from skulk.types.chunks import ErrorChunk
from skulk.types.commands import (
    Command,
    CreateInstance,
    CreateMetaInstance,
    DeleteMetaInstance,
    ForwardedCommand,
    OfferDesiredState,
    PlaceInstance,
)
from skulk.types.desired import RestoredCopy
from skulk.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceRetrying,
    LocalEvent,
    MetaInstanceCreated,
    MetaInstancePlacementFailed,
    ModelCardAdded,
    TaskFailed,
    TopologyEdgeCreated,
)
from skulk.types.ids import ModelId, NodeId, TaskId, new_id
from skulk.types.models import ModelCard
from skulk.types.state import State

log = logging.getLogger("skulk.master")

RECONCILE_EVERY_S = 1.0


class Master:
    def __init__(
        self,
        transport: Transport,
        node_id: NodeId,
        term: int,
        state: State,
        alive: Callable[[], frozenset[NodeId]],
        frozen: Callable[[], bool] = lambda: False,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any] | None] | None = None,
        restart_budget: int = RESTART_BUDGET,
        restart_window_s: float = RESTART_WINDOW_S,
        desired: DesiredState | None = None,
        desired_copy: RestoredCopy | None = None,
        data_ports: range = RENDEZVOUS_PORTS,
    ) -> None:
        self.desired = desired
        """This node's saved desired state: restored if this master starts a cluster afresh (state/desired)."""
        self.desired_copy = desired_copy
        """How that copy ranks (whole or not, when saved): a follower's offer must rank above it to add to it."""
        self._offers_until: float | None = None
        """Until when (monotonic) followers' offered copies count: set when this master starts a cluster afresh,
        closed by the first DeleteMetaInstance (state/desired_offer.py)."""
        self.restart_budget = restart_budget
        self.restart_window_s = restart_window_s
        self.ids = reconcile.Ids(port=lambda: new_rendezvous_port(
            data_ports, rendezvous_ports(self.state), span=max(len(self.state.topology.nodes), 1)))
        """Rendezvous ports from this node's data ports, room left for the widest ring the cluster could place."""
        self._transport = transport
        self._spawn = spawn or asyncio.get_running_loop().create_task
        self.node_id = node_id
        self.term = term
        self.state = state
        self.alive = alive
        self.frozen = frozen
        """True while this process is back from a freeze and has not stepped down yet: its view of who is
        alive is stale (every lease looks expired), so it must not declare anyone lost on it."""
        self.sequencer = Sequencer(
            transport,
            first_idx=state.last_event_applied_idx + 1,
            snapshot=self._snapshot,
            term=term,
            master=node_id,
        )
        self.intake = Intake(transport, on_local_event=self.on_local_event, on_command=self.on_command, term=term,
                             master=node_id)
        self._reconciler: asyncio.Task[None] | None = None

    def _snapshot(self) -> bytes:
        return self.state.model_dump_json().encode()

    def start(self) -> None:
        session = events_for_new_session(self.state, self.node_id, self.term)
        failed = sum(isinstance(e, TaskFailed) for e in session)
        log.info("master %s starts term %d at event %d; failing %d open requests of the old session",
                 self.node_id[:8], self.term, self.sequencer.next_idx, failed)
        fresh = self.sequencer.next_idx == 0
        self.sequencer.start()
        self.intake.start()
        self.emit(session)
        if fresh:
            self._offers_until = time.monotonic() + OFFER_WINDOW_S
            self._restore()
        self.reconcile()
        self._reconciler = self._spawn(self._reconcile_forever())

    def _restore(self) -> None:
        """The first master of a (re)started cluster brings back what an operator created: every node saved it,
        and nobody had state to hand this one (it was elected with no event applied). Its own copy first; the
        followers' offers may add to it (`_offer`)."""
        events = own_copy_events(self.state, self.desired, self.desired_copy)
        if events:
            metas = sum(isinstance(e, MetaInstanceCreated) for e in events)
            log.info("restoring the saved desired state: %d MetaInstances, %d model cards", metas,
                     sum(isinstance(e, ModelCardAdded) for e in events))
            self.emit(events)

    @property
    def offers_open(self) -> bool:
        return self._offers_until is not None and time.monotonic() < self._offers_until

    def _offer(self, offer: OfferDesiredState) -> list[Event]:
        """A follower's saved copy: restored (what is missing) if this cluster's start is fresh and it ranks
        above what was restored so far; otherwise left alone. Never a refusal to the follower: it only waits."""
        if not self.offers_open:
            log.info("desired state offered by %s ignored: this cluster did not just start", offer.origin[:8])
            return []
        events, why = offer_events(self.state, offer)
        log.info("desired state offered by %s: %s", offer.origin[:8], why if events else f"not restored, {why}")
        return events

    def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
        self.intake.stop()
        self.sequencer.stop()

    def emit(self, events: list[Event]) -> None:
        if not events:
            return
        for indexed in self.sequencer.emit(events):
            self.state = apply(self.state, indexed)

    def on_command(self, forwarded: ForwardedCommand) -> None:
        with log_context(command_id=forwarded.command.command_id):
            self._on_command(forwarded.command)

    def _on_command(self, command: Command) -> None:
        try:
            events = self._decide(command)
        except commands.Refused as refused:
            log.info("command %s refused: %s", command.command_id[:8], refused.message)
            chunk = ErrorChunk(command_id=command.command_id, message=refused.message, code=refused.code,
                               status=refused.status, retryable=False)
            publish_chunk(self._transport, chunk, getattr(command, "origin_node_id", None))
            return
        for event in events:
            if isinstance(event, InstanceDeleted):
                log.info("instance %s deleted on request (command %s)", event.instance_id[:8], command.command_id[:8])
        self.emit(events)
        if isinstance(command, CreateMetaInstance):
            self._place_meta(command)

    def _decide(self, command: Command) -> list[Event]:
        match command:
            case CreateInstance():
                return commands.create_instance(self.state, command)
            case PlaceInstance():
                card_of = (lambda _m: command.model_card) if command.model_card is not None else self._card_of
                return commands.place_instance(self.state, command, card_of, self.ids)
            case CreateMetaInstance(meta_instance=meta):
                if meta.meta_instance_id in self.state.meta_instances:
                    return []
                log.info("MetaInstance %s created: %s, min_nodes %d, %s", meta.meta_instance_id[:8], meta.model_id,
                         meta.min_nodes, meta.sharding.value)
                return [MetaInstanceCreated(meta_instance=meta)]
            case OfferDesiredState():
                return self._offer(command)
            case DeleteMetaInstance():
                self._offers_until = None  # an offer must not bring back what the operator just deleted
                events = commands.delete_meta_instance(self.state, command)
                cascade = sum(isinstance(e, InstanceDeleted) for e in events)
                if events:
                    log.info("MetaInstance %s deleted (cascade: %d instances)", command.meta_instance_id[:8], cascade)
                return events
        return events_for_command(self.state, command, TaskId(new_id()))

    def _card_of(self, model_id: ModelId) -> ModelCard | None:
        """Packaged cards, then the custom ones any node added (they live in state)."""
        return card_of(self.state, model_id)

    def _place_meta(self, command: CreateMetaInstance) -> None:
        """Placed at once if possible; the state is re-read here, so a reconcile that already placed it wins."""
        only = command.meta_instance.meta_instance_id
        if command.first_node_ids:
            first = reconcile.first_placement(self.state, command.meta_instance, command.first_node_ids,
                                              self._card_of, self.ids)
            if first:
                self._emit_placements(first)
                return
        self._emit_placements(reconcile.unsatisfied_placements(self.state, self._card_of, self.ids, only=only))

    def _emit_placements(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, InstanceCreated):
                log.info("MetaInstance %s placed as instance %s on %d node(s)",
                         (event.instance.meta_instance_id or "")[:8], event.instance.instance_id[:8],
                         event.instance.world_size)
            elif isinstance(event, MetaInstancePlacementFailed):
                log.warning("MetaInstance %s cannot be placed: %s", event.meta_instance_id[:8], event.reason)
        self.emit(events)

    def on_local_event(self, local: LocalEvent) -> None:
        if not commands.accepts_local(self.state, local):
            log.warning("dropped %s from node %s: a worker may report only its own node, runners and tasks",
                        type(local.event).__name__, local.origin[:8])
            return
        self.emit([local.event])
        if isinstance(local.event, TopologyEdgeCreated):
            self._place_now()

    def on_node_lost(self, node: NodeId, why: str = "its liveliness token is gone") -> None:
        if self.frozen():
            return
        events = events_for_lost_node(self.state, node)
        if not events:
            return
        deleted = [e.instance_id[:8] for e in events if isinstance(e, InstanceDeleted)]
        failed = sum(isinstance(e, TaskFailed) for e in events)
        log.info("node %s lost (%s): deleting instances %s, failing %d open requests", node[:8], why,
                 deleted or "none", failed)
        self.emit(events)
        if deleted:
            self._place_now()

    def _place_now(self) -> None:
        """Place what a MetaInstance lacks now rather than at the next reconcile tick: after a node's loss
        deleted an instance, and when a new link may have closed the cycle a placement waits for. Measured
        (bench/recovery.py, issue 38): the tick added 0.5-1 s between a shard holder's loss and its
        replacement, and as much between a restarted cluster's last link and its first placement. Only while
        every node this master knows is alive, so a second lost node is never chosen before it is removed."""
        if self.frozen() or not set(self.state.topology.nodes) | set(self.state.last_seen) <= self.alive():
            return
        self._emit_placements(reconcile.unsatisfied_placements(self.state, self._card_of, self.ids))

    def reconcile(self) -> None:
        if self.frozen():
            return
        alive = self.alive()
        known = set(self.state.topology.nodes) | set(self.state.last_seen)
        health = reconcile.instance_health(self.state)
        self._log_health(health)
        self.emit(health)
        for node in sorted(known - alive):
            self.on_node_lost(node, "not alive in this master's view")
        self.emit(
            events_for_unhealthy_instances(self.state, budget=self.restart_budget, window_s=self.restart_window_s)
        )
        self._emit_placements(reconcile.unsatisfied_placements(self.state, self._card_of, self.ids))

    def _log_health(self, events: list[Event]) -> None:
        for event in events:
            if not isinstance(event, InstanceRetrying | InstanceDeleted):
                continue
            instance = self.state.instances.get(event.instance_id)
            meta_id = instance.meta_instance_id if instance is not None else None
            meta = self.state.meta_instances.get(meta_id) if meta_id is not None else None
            attempt = meta.consecutive_failures + 1 if meta is not None else 0
            limit = reconcile.MAX_INSTANCE_RETRIES
            if isinstance(event, InstanceRetrying):
                log.info("Instance %s failed (attempt %d/%d), retrying: %s", event.instance_id[:8], attempt, limit,
                         event.failure_error)
            elif event.failure_error == reconcile.CONNECTION_LOST:
                log.info("Instance %s deleted: %s", event.instance_id[:8], event.failure_error)
            else:
                log.warning("Instance %s exceeded retry limit (%d), deleting: %s", event.instance_id[:8], limit,
                            event.failure_error)

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed")
