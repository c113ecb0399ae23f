"""MetaInstances (seed 003): "an instance matching these parameters always exists", kept true by the master.

The binding is the `meta_instance_id` on the backing instance, set only by the master's reconciler: there is no
binding event and no backing map, so deleting an instance unbinds it in the same step.
"""

from __future__ import annotations

from pydantic import Field

from .backends import EngineChoice
from .base import CamelModel
from .ids import MetaInstanceId, ModelId, NodeId
from .instances import InstanceMeta, Sharding
from .models import KvCacheBits
from .placement import KvCacheGb, KvSizing, MaxContext

MAX_INSTANCE_RETRIES = 3
"""Consecutive failures of a backing instance retried in place before it is deleted and placed anew."""


class MetaInstance(CamelModel):
    """Frozen (every CamelModel is). Failure fields: consecutive_failures and last_failure_error are always set
    together by apply; placement_error says why the last placement attempt failed (None once one succeeds)."""

    meta_instance_id: MetaInstanceId
    model_id: ModelId
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    engine: EngineChoice = "auto"
    min_nodes: int = Field(default=1, ge=1, le=64)
    node_ids: list[NodeId] | None = None
    kv_cache_gb: KvCacheGb | None = None
    max_context: MaxContext | None = None
    kv_cache_bits: KvCacheBits | None = None
    placement_error: str | None = None
    consecutive_failures: int = 0
    last_failure_error: str | None = None

    @property
    def sizing(self) -> KvSizing:
        return KvSizing(kv_cache_gb=self.kv_cache_gb, max_context=self.max_context, kv_cache_bits=self.kv_cache_bits)
