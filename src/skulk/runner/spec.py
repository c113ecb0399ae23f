"""Everything a runner process needs to know at birth. Picklable; crosses the spawn boundary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skulk.types.diagnostics import RunnerContext
from skulk.types.ids import InstanceId, NodeId, RunnerId
from skulk.types.instances import EngineKind, Rendezvous, Sharding
from skulk.types.shards import PipelineShardMetadata, TensorShardMetadata


@dataclass(frozen=True)
class RunnerSpec:
    node_id: NodeId
    runner_id: RunnerId
    instance_id: InstanceId
    shard: PipelineShardMetadata | TensorShardMetadata
    sharding: Sharding
    model_dir: Path
    rendezvous: Rendezvous | None = None
    warmup_deadline_s: float = 300.0
    connect_deadline_s: float = 60.0
    group_timeout_s: float = 10.0
    prefill_chunk_tokens: int = 512
    record: bool = True
    fault: str | None = None
    attempt: int = 0  # the instance attempt this runner serves (restarts of a multi-rank instance count up)
    engine: EngineKind = "torch"  # which engine runs this rank (the instance's, chosen at placement)
    ring_hosts: tuple[str, ...] = ()  # MLX ranks: host:port where each rank listens (MLX's ring hostfile)
    context_length: int | None = None  # what the instance admits (placement's; None: the model's own)
    kv_cache_bytes: int | None = None  # this rank's KV pool, reserved by placement (None: the engine's default)
    draft_dir: Path | None = None  # the card's draft model, when here (a single torch rank speculates with it)
    mixed: bool = False  # the instance's ranks run different engines and all speak torch's group wire

    def context(self, pid: int | None) -> RunnerContext:
        shard = self.shard
        return RunnerContext(
            node_id=self.node_id,
            runner_id=self.runner_id,
            pid=pid,
            instance_id=self.instance_id,
            model_id=shard.model_card.model_id,
            rank=shard.device_rank,
            world_size=shard.world_size,
            start_layer=shard.start_layer,
            end_layer=shard.end_layer,
            n_layers=shard.n_layers,
        )
