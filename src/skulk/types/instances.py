"""A placed model: which runner on which node owns which shard, and how the ranks meet."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Discriminator, Tag

from .backends import EngineName
from .base import CamelModel, TaggedModel, tag_of
from .ids import InstanceId, MetaInstanceId, ModelId, NodeId, RunnerId
from .shards import ShardMetadata


class Sharding(StrEnum):
    Pipeline = "Pipeline"
    Tensor = "Tensor"


class InstanceMeta(StrEnum):
    """Skulk's instance kinds; MlxJaccl (RDMA over Thunderbolt) is refused on this build."""

    MlxRing = "MlxRing"
    MlxJaccl = "MlxJaccl"


EngineKind = EngineName
"""The engine an instance's ranks run (types/backends.py)."""


class ShardAssignments(CamelModel):
    model_id: ModelId
    runner_to_shard: dict[RunnerId, ShardMetadata]
    node_to_runner: dict[NodeId, RunnerId]


class Rendezvous(CamelModel):
    """Where rank 0 of a torch.distributed group listens; chosen at placement."""

    host: str
    port: int


class MlxRingInstance(TaggedModel):
    instance_id: InstanceId
    shard_assignments: ShardAssignments
    sharding: Sharding = Sharding.Pipeline
    engine: EngineKind = "torch"
    """Every rank's engine; in a mixed instance (engine_by_node set) the wire its ranks speak: torch's group."""
    engine_by_node: dict[NodeId, EngineKind] | None = None
    """A mixed Pipeline: each node's engine (an MLX rank beside torch ranks, engines/mlx/mixed.py); None: all
    run `engine`."""
    rendezvous: Rendezvous | None = None
    meta_instance_id: MetaInstanceId | None = None
    """The MetaInstance this instance backs; set only by the master's reconciler (None: placed directly)."""
    context_length: int | None = None
    """The context this instance admits, chosen at placement: the model's max_position_embeddings, capped by the
    placement's max_context. Every API surface advertises it (None: an instance written without it admits the
    model's own context)."""
    kv_cache_bytes: dict[RunnerId, int] = {}
    """Each rank's KV block pool, reserved by placement beside the weights (a Pipeline rank holds only its layers'
    KV, a Tensor rank its heads'). A runner missing here sizes its pool by the engine's default."""

    @property
    def model_id(self) -> ModelId:
        return self.shard_assignments.model_id

    @property
    def world_size(self) -> int:
        return len(self.shard_assignments.runner_to_shard)

    @property
    def admits(self) -> int:
        """The longest context (prompt plus generation) this instance serves."""
        if self.context_length is not None:
            return self.context_length
        return next(iter(self.shard_assignments.runner_to_shard.values())).model_card.context_length

    @property
    def mixed(self) -> bool:
        return self.engine_by_node is not None and len(set(self.engine_by_node.values())) > 1

    def engines(self) -> dict[NodeId, EngineKind]:
        """Each node's engine."""
        given = self.engine_by_node or {}
        return {n: given.get(n, self.engine) for n in self.shard_assignments.node_to_runner}


Instance = Annotated[Annotated[MlxRingInstance, Tag("MlxRingInstance")], Discriminator(tag_of)]
