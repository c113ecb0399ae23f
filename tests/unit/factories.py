"""Small builders for states, instances and the API's services used across unit tests."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from skulk.api.requests import Requests
from skulk.api.services import ApiServices
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport
from skulk.config import Settings
from skulk.restart import RestartGate
from skulk.state.apply import apply
from skulk.state.store import StateStore
from skulk.store.service import ModelFiles
from skulk.tracing.store import TraceStore
from skulk.types.commands import Command
from skulk.types.events import Event, IndexedEvent
from skulk.types.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from skulk.types.instances import MlxRingInstance, ShardAssignments
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from skulk.types.shards import PipelineShardMetadata
from skulk.types.state import State
from skulk.types.tasks import ChatCompletion

CARD = ModelCard(
    model_id=ModelId("test/model"),
    family="llama",
    n_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    storage_size=Memory.from_gb(1),
)


def instance(instance_id: str = "inst", nodes: tuple[str, ...] = ("n1",)) -> MlxRingInstance:
    world = len(nodes)
    per = CARD.n_layers // world
    runner_to_shard = {
        RunnerId(f"r-{node}"): PipelineShardMetadata(
            model_card=CARD,
            device_rank=rank,
            world_size=world,
            start_layer=rank * per,
            end_layer=CARD.n_layers if rank == world - 1 else (rank + 1) * per,
            n_layers=CARD.n_layers,
        )
        for rank, node in enumerate(nodes)
    }
    return MlxRingInstance(
        instance_id=InstanceId(instance_id),
        shard_assignments=ShardAssignments(
            model_id=CARD.model_id,
            runner_to_shard=runner_to_shard,
            node_to_runner={NodeId(n): RunnerId(f"r-{n}") for n in nodes},
        ),
    )


def chat_task(task_id: str = "t1", instance_id: str = "inst", command_id: str = "c1") -> ChatCompletion:
    return ChatCompletion(
        task_id=TaskId(task_id),
        command_id=CommandId(command_id),
        instance_id=InstanceId(instance_id),
        model=CARD.model_id,
    )


def applied(*events: Event, state: State | None = None) -> State:
    state = state or State()
    for event in events:
        state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))
    return state


class QuietTransport:
    """A transport for an API built in-process: subscriptions that hear nothing, puts and queries that reach no
    one. A stream over it times out like one whose runner never answers."""

    sealer = None
    mixed_versions = False

    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes]] = []

    def subscribe(self, key: str, callback: Callable[[str, bytes], None]) -> object:
        return object()

    def undeclare(self, subscription: object) -> None:
        pass

    def put(self, key: str, payload: bytes) -> None:
        self.puts.append((key, payload))

    def matched(self, key: str) -> bool:
        return False

    def serve(self, key: str, answer: Callable[[str, str], bytes | None]) -> None:
        pass


def api_services(
    state: State | None = None,
    *,
    node_id: str = "n1",
    master: str | None = "n1",
    settings: Settings | None = None,
    commands: Callable[[Command], None] | None = None,
    runners: Mapping[RunnerId, Any] | None = None,
    departed: Mapping[NodeId, Any] | None = None,
    home: Path | None = None,
) -> ApiServices:
    """The ApiServices a node builds, over a fixed state and in-process components: what create_app and every
    router take in tests too."""
    home = home or Path(tempfile.mkdtemp(prefix="skulk-api-"))
    settings = settings or Settings(config=home / "skulk.yaml", home=home)
    store = StateStore(state or State())
    sent: list[Command] = []
    send = commands or sent.append
    transport = cast(Transport, QuietTransport())
    payloads = PayloadBook(transport, NodeId(node_id))
    return ApiServices(
        node_id=NodeId(node_id), settings=settings, store=store, commands=send,
        requests=Requests(transport, payloads, send), files=ModelFiles(settings, NodeId(node_id), lambda _: None),
        traces=TraceStore(home / "traces", node_id), event_log=None, restart=RestartGate(),
        master=lambda: NodeId(master) if master else None, runners=lambda: runners or {},
        departed=lambda: departed or {}, sealer=lambda: None, members=lambda: (frozenset(), frozenset()),
    )
