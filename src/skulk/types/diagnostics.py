"""Flight-recorder entries and memory snapshots (seed 001), recorded by runners, kept by supervisors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from .memory import Memory
from .runners import RunnerPhase

AttrValue = str | int | float | bool | list[str]


class DiagModel(BaseModel):
    """The diagnostics wire conventions: camelCase out, either spelling in, frozen; unknown keys tolerated (a
    bundle read from a peer of another version must not fail the whole answer)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, serialize_by_alias=True
    )


class MlxMemorySnapshot(DiagModel):
    """Named for Skulk's wire schema; filled by whichever runtime runs the shard, which `source` names."""

    generated_at: str
    active: Memory | None = None
    cache: Memory | None = None
    peak: Memory | None = None
    wired_limit: Memory | None = None
    source: str


class RunnerContext(DiagModel):
    node_id: str
    runner_id: str
    pid: int | None = None
    instance_id: str
    model_id: str
    rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int


class FlightRecorderEntry(DiagModel):
    at: str
    phase: RunnerPhase
    event: str
    detail: str | None = None
    attrs: dict[str, AttrValue] = {}
    context: RunnerContext
    task_id: str | None = None
    command_id: str | None = None
    mlx_memory: MlxMemorySnapshot | None = None


class Milestone(DiagModel):
    at: str
    name: str
    detail: str | None = None
