"""MetaInstances (seed 003): POST /meta_instance, DELETE /meta_instance/{id}, GET /meta_instances.

A MetaInstance says "an instance matching these parameters always exists"; the master keeps it true (places,
retries, re-places). Deleting one cascades to its backing instance in the master, in one batch.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from skulk.api.control import PLACED_WAIT_S, card_or_404
from skulk.api.openapi import documented
from skulk.api.services import ApiServices
from skulk.diagnostics.meta import meta_status
from skulk.types.answers import MetaInstanceCommand, MetaInstances
from skulk.types.backends import EngineChoice
from skulk.types.commands import CreateMetaInstance, DeleteMetaInstance
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, MetaInstanceId, ModelId, NodeId, new_id
from skulk.types.instances import InstanceMeta, Sharding
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import KvCacheBits
from skulk.types.placement import KvCacheGb, MaxContext


class CreateMetaInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(min_length=1)
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    engine: EngineChoice = "auto"
    min_nodes: int = Field(default=1, ge=1, le=64)
    node_ids: list[NodeId] | None = Field(default=None, min_length=1)
    first_node_ids: list[NodeId] | None = Field(default=None, min_length=1)
    """The first instance on exactly these nodes (a preview's), re-placed by node_ids/min_nodes afterwards."""
    kv_cache_gb: KvCacheGb | None = None
    """The instance's KV pool in GiB, all ranks together (unset: the card's, else a share of free memory)."""
    max_context: MaxContext | None = None
    """The longest context the instance admits, capped by the model's own (unset: the model's own)."""
    kv_cache_bits: KvCacheBits | None = None
    """16, 8 or 4: the KV cache's bits (unset: this node's SKULK_KV_CACHE_BITS, else the card's, else 16)."""


def meta_instances_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["meta_instances"])

    @router.post("/meta_instance", response_model=None, responses=documented(MetaInstanceCommand, 404))
    async def create(body: CreateMetaInstanceRequest) -> dict[str, Any]:
        card = card_or_404(body.model_id)
        meta = MetaInstance(
            meta_instance_id=MetaInstanceId(new_id()),
            model_id=ModelId(card.model_id),
            sharding=body.sharding,
            instance_meta=body.instance_meta,
            engine=body.engine,
            min_nodes=body.min_nodes,
            node_ids=body.node_ids,
            kv_cache_gb=body.kv_cache_gb,
            max_context=body.max_context,
            kv_cache_bits=body.kv_cache_bits if body.kv_cache_bits is not None else node.settings.kv_cache_bits,
        )
        command_id = CommandId(new_id())
        node.send_command(CreateMetaInstance(command_id=command_id, meta_instance=meta,
                                             first_node_ids=body.first_node_ids))
        await node.wait_for_state(lambda s: meta.meta_instance_id in s.meta_instances, PLACED_WAIT_S)
        return {"message": "Command received.", "command_id": command_id, "meta_instance_id": meta.meta_instance_id}

    @router.delete("/meta_instance/{meta_instance_id}", response_model=None,
                   responses=documented(MetaInstanceCommand, 404))
    async def delete(meta_instance_id: str) -> dict[str, Any]:
        mid = MetaInstanceId(meta_instance_id)
        if mid not in node.state.meta_instances:
            raise ApiError(ErrorCode.not_found, "MetaInstance not found")
        command_id = CommandId(new_id())
        node.send_command(DeleteMetaInstance(command_id=command_id, meta_instance_id=mid))
        await node.wait_for_state(lambda s: mid not in s.meta_instances, PLACED_WAIT_S)
        return {"message": "Command received.", "command_id": command_id, "meta_instance_id": mid}

    @router.get("/meta_instances", response_model=None, responses=documented(MetaInstances))
    async def listing() -> dict[str, Any]:
        state = node.state
        return {
            "meta_instances": {
                mid: {
                    **meta.model_dump(mode="json"),
                    "status": meta_status(state, meta),
                    "instance_ids": sorted(i.instance_id for i in state.instances.values()
                                           if i.meta_instance_id == mid),
                }
                for mid, meta in state.meta_instances.items()
            }
        }

    return router
