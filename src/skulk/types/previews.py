"""GET /instance/previews as Skulk writes it: snake_case keys, the instance as a tagged union, error a string.

Skulk's clients filter on `sharding`/`instance_meta` and `error is None`, then POST the preview's `instance` to
/instance, so these names and types are the contract."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .backends import EngineName
from .ids import ModelId
from .instances import Instance, InstanceMeta, Sharding


class SkulkPlacementPreview(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: ModelId
    sharding: Sharding
    instance_meta: InstanceMeta
    instance: Instance | None = None
    memory_delta_by_node: dict[str, int] | None = None
    """Bytes each node of the instance would take on: its share of the weights, overhead and its KV pool."""
    engine_by_node: dict[str, EngineName] | None = None
    """The engine each node of the instance would run (this project's addition, beside Skulk's fields)."""
    predicted_decode_tps: float | None = None
    """One stream's decode tok/s this placement is predicted to reach (master/speed.py), from the nodes' learned
    compute and measured links; None until some node has served a request and the ring's links were measured."""
    predicted_aggregate_tps: float | None = None
    """All `predicted_batch` streams together, tok/s (None as above, or when no node has served a batch near it)."""
    predicted_batch: int | None = None
    predicted_warning: str | None = None
    """Set when this split is predicted to decode one stream slower than a placement on fewer nodes."""
    kv_cache_bytes_by_node: dict[str, int] | None = None
    """Each node's KV block pool, part of memory_delta_by_node (this project's addition)."""
    weights_bytes_by_node: dict[str, int] | None = None
    """Each node's weight bytes, part of memory_delta_by_node: its layers' exact bytes, the embedding on the first
    rank and the head on the last where the card has per-layer memory (this project's addition)."""
    runtime_bytes_by_node: dict[str, int] | None = None
    """Each node's runner runtime overhead, part of memory_delta_by_node: what that node's runners measured, or
    the default ceiling until one has (this project's addition; runtime_measured_by_node says which)."""
    runtime_measured_by_node: dict[str, bool] | None = None
    context_length: int | None = None
    """The context the instance would admit (this project's addition)."""
    error: str | None = None
