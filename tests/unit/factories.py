"""Small builders for states and instances used across unit tests."""

from __future__ import annotations

from skulk.state.apply import apply
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
