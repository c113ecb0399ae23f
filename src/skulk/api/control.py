"""Placement and instance control: /place_instance, /instance, /instance/previews, /instance/{id}, /v1/cancel/{id}."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from skulk.api.openapi import documented
from skulk.api.previews import skulk_previews
from skulk.api.security import OWNERS
from skulk.api.services import ApiServices
from skulk.engines.kv_pools import KV_BITS
from skulk.master.engine_choice import instance_engine_error
from skulk.master.placement import new_rendezvous_port, place
from skulk.models.cards import get_card, with_quantization
from skulk.types.answers import (
    CancelRequested,
    CreatedInstance,
    DeletedInstance,
    InstanceView,
    PlacedInstance,
    Previews,
)
from skulk.types.backends import EngineChoice
from skulk.types.chunks import ErrorChunk
from skulk.types.commands import CancelCommand, Command, CreateInstance, DeleteInstance, PlaceInstance
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, new_id
from skulk.types.instances import Instance, InstanceMeta, MlxRingInstance, Sharding
from skulk.types.models import KvCacheBits, ModelCard, QuantizeAtLoad
from skulk.types.placement import InfoPending, KvCacheGb, KvSizing, MaxContext, NoConnectedCycle, PlacementError
from skulk.types.state import State

INFO_GRACE_S = 15.0
PLACED_WAIT_S = 10.0


class PlaceInstanceRequest(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    model_id: str = Field(min_length=1)
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    min_nodes: int = Field(default=1, ge=1, le=64)
    excluded_nodes: list[NodeId] = []
    engine: EngineChoice = "auto"
    """Which engine runs the ranks: auto (each ring its best: MLX where every node has Metal, else torch),
    torch or mlx; a node that lacks it is never chosen, and a ring of only such nodes is a 400 naming one."""
    quantization: QuantizeAtLoad | None = None
    """Quantize a float checkpoint's weights while loading (weight-only int4/int8): about 1/3.5 or 1/2 of a
    bf16 model's memory, so it fits where the float one does not."""
    kv_cache_gb: KvCacheGb | None = None
    """The instance's KV block pool in GiB, all ranks together; each node must fit its weights and its rank's share
    (unset: the card's kv_cache_gb, else a quarter of what the tightest node has free after its weights)."""
    max_context: MaxContext | None = None
    """The longest context (prompt plus generation) the instance admits, capped by the model's own
    max_position_embeddings (unset: the model's own). Longer requests get a 400 naming the limit."""
    kv_cache_bits: KvCacheBits | None = None
    """16, 8 or 4: keys and values in the model's dtype, or quantized to int8 / int4 with float16 scales (about 1/2
    or 1/3.5 of bf16's bytes a position, so a pool holds that much more context); torch engine only (unset: this
    node's SKULK_KV_CACHE_BITS, else the card's, else 16)."""

    @property
    def sizing(self) -> KvSizing:
        return KvSizing(kv_cache_gb=self.kv_cache_gb, max_context=self.max_context, kv_cache_bits=self.kv_cache_bits)


class CreateInstanceRequest(BaseModel):
    """Skulk's POST /instance: an instance exactly as a preview (or GET /instance/{id}) wrote it."""

    model_config = ConfigDict(extra="forbid")
    instance: Instance


def card_or_404(model_id: str) -> ModelCard:
    card = get_card(model_id)
    if card is None:
        raise ApiError(ErrorCode.model_not_found,
                       f"unknown model {model_id}; GET /models lists the models this cluster knows")
    return card


def card_for(request: PlaceInstanceRequest) -> ModelCard:
    """The card a placement runs: the model's, quantized at load when the request asks."""
    try:
        return with_quantization(card_or_404(request.model_id), request.quantization)
    except ValueError as exc:
        raise ApiError(ErrorCode.invalid_quantization, str(exc)) from exc


def plan_instance(
    state: State, request: PlaceInstanceRequest, card: ModelCard
) -> MlxRingInstance | PlacementError:
    return place(
        state,
        card,
        sharding=request.sharding,
        instance_meta=request.instance_meta,
        min_nodes=request.min_nodes,
        excluded_nodes=set(request.excluded_nodes),
        engine=request.engine,
        sizing=request.sizing,
        instance_id=InstanceId(new_id()),
        new_runner_id=lambda: RunnerId(new_id()),
        rendezvous_port=new_rendezvous_port(),
    )


def edges_pending(state: State) -> bool:
    """Edges lag node info right after formation: some pair of known nodes has no probed link yet."""
    nodes = state.topology.nodes
    linked = {(c.source, c.sink) for c in state.topology.connections}
    return any(a != b and (a, b) not in linked for a in nodes for b in nodes)


def _still_arriving(state: State, me: NodeId, outcome: MlxRingInstance | PlacementError) -> bool:
    if me not in state.node_memory:
        return True
    return isinstance(outcome, InfoPending) or (isinstance(outcome, NoConnectedCycle) and edges_pending(state))


async def place_with_grace(node: ApiServices, request: PlaceInstanceRequest) -> MlxRingInstance:
    """Right after formation node info and edges are still arriving: wait for them rather than refuse falsely."""
    card = card_for(request)
    outcome = plan_instance(node.state, request, card)
    if _still_arriving(node.state, node.node_id, outcome):
        await node.wait_for_state(
            lambda s: not _still_arriving(s, node.node_id, plan_instance(s, request, card)), INFO_GRACE_S
        )
        outcome = plan_instance(node.state, request, card)
        if node.node_id not in node.state.node_memory:
            outcome = InfoPending(node_ids=[node.node_id])
    if isinstance(outcome, PlacementError):
        raise ApiError(outcome.code, outcome.message)
    return outcome


async def place_on_master(
    node: ApiServices, request: PlaceInstanceRequest, planned: MlxRingInstance, command_id: CommandId
) -> MlxRingInstance:
    """The API's own plan only vets the request (typed errors, the info grace); the master decides, against
    the instances it already committed, and answers with the instance in state or a refusal on our data key."""
    command = PlaceInstance(
        command_id=command_id,
        instance_id=planned.instance_id,
        model_id=planned.model_id,
        sharding=request.sharding,
        instance_meta=request.instance_meta,
        min_nodes=request.min_nodes,
        excluded_nodes=request.excluded_nodes,
        engine=request.engine,
        model_card=card_for(request),
        kv_cache_gb=request.kv_cache_gb,
        max_context=request.max_context,
        kv_cache_bits=request.kv_cache_bits,
    )
    return await send_and_await_instance(node, command, planned.instance_id)


async def send_and_await_instance(node: ApiServices, command: Command, instance_id: InstanceId) -> MlxRingInstance:
    """Send a placing command; the instance once it is in state, or the master's refusal as an ApiError."""
    stream = node.requests.open(command.command_id)
    try:
        node.send_command(command)
        placed = asyncio.ensure_future(
            node.wait_for_state(lambda s: instance_id in s.instances, PLACED_WAIT_S)
        )
        refused = asyncio.ensure_future(stream.next(PLACED_WAIT_S))
        done, pending = await asyncio.wait({placed, refused}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    finally:
        node.requests.close(stream)
    instance = node.state.instances.get(instance_id)
    if instance is not None:
        return instance
    if refused in done and not refused.cancelled() and refused.exception() is None:
        chunk = refused.result()
        if isinstance(chunk, ErrorChunk):
            raise ApiError(chunk.code, chunk.message, status=chunk.status)
    raise ApiError(ErrorCode.placement_timeout,
                   "the master did not confirm the placement in time; GET /state, then retry")


def control_router(node: ApiServices) -> APIRouter:
    router = APIRouter(tags=["control"])

    @router.post("/place_instance", response_model=None, responses=documented(PlacedInstance, 400, 404, 503))
    async def place_instance(body: PlaceInstanceRequest) -> dict[str, Any]:
        if body.kv_cache_bits is None and node.settings.kv_cache_bits is not None:
            body = body.model_copy(update={"kv_cache_bits": node.settings.kv_cache_bits})
        planned = await place_with_grace(node, body)
        command_id = CommandId(new_id())
        instance = await place_on_master(node, body, planned, command_id)
        return {
            "message": "Command received.",
            "commandId": command_id,
            "instanceId": instance.instance_id,
            "modelId": instance.model_id,
            "instance": instance.model_dump(mode="json"),
        }

    @router.post("/instance", response_model=None, responses=documented(CreatedInstance, 400, 404, 503))
    async def create_instance(body: CreateInstanceRequest) -> dict[str, Any]:
        """Place exactly this instance (a preview's `instance`): the master refuses taken ids."""
        instance = body.instance
        card = card_or_404(instance.model_id)
        unknown = sorted(set(instance.shard_assignments.node_to_runner) - set(node.state.topology.nodes))
        if unknown or not instance.shard_assignments.node_to_runner:
            raise ApiError(ErrorCode.invalid_request,
                           f"instance.shardAssignments.nodeToRunner names nodes not in this cluster: {unknown}; "
                           "GET /instance/previews for placements on the current nodes")
        if instance.instance_id in node.state.instances:
            raise ApiError(ErrorCode.invalid_request,
                           f"instance id {instance.instance_id} is already in use; GET /instance/previews for "
                           "a fresh placement")
        lacking = instance_engine_error(card, instance.engines(), node.state.node_backends, sharding=instance.sharding)
        if lacking is not None:
            raise ApiError(lacking.code, lacking.message)
        command_id = CommandId(new_id())
        await send_and_await_instance(node, CreateInstance(command_id=command_id, instance=instance),
                                      instance.instance_id)
        return {"message": "Command received.", "command_id": command_id,
                "model_card": card.model_dump(mode="json")}

    @router.get("/instance/previews", response_model=None, responses=documented(Previews, 400, 404))
    async def previews(
        model_id: str = Query(min_length=1),
        sharding: Sharding | None = None,
        instance_meta: InstanceMeta | None = None,
        excluded_node_ids: list[NodeId] = Query(default=[]),  # noqa: B008 - FastAPI's query declaration
        engine: EngineChoice = "auto",
        quantization: QuantizeAtLoad | None = None,
        kv_cache_gb: float | None = Query(default=None, gt=0, le=65536),
        max_context: int | None = Query(default=None, ge=2, le=1 << 24),
        kv_cache_bits: int | None = Query(default=None, description="16, 8 or 4"),
    ) -> dict[str, Any]:
        """Skulk's shape: `{"previews": [{model_id, sharding, instance_meta, instance, memory_delta_by_node,
        error}]}`; `downloads` (each node's copy of the model) rides along for this project's own clients.
        `quantization`: the placements of the model quantized at load, as POST /place_instance would run it;
        kv_cache_gb, max_context and kv_cache_bits size the KV pool and context as a placement's would."""
        card = card_or_404(model_id)
        if quantization is not None:
            try:
                card = with_quantization(card, quantization)
            except ValueError as exc:
                raise ApiError(ErrorCode.invalid_quantization, str(exc)) from exc
        shardings = [sharding] if sharding else list(Sharding)
        metas = [instance_meta] if instance_meta else list(InstanceMeta)
        if kv_cache_bits is not None and kv_cache_bits not in KV_BITS:  # a query's text: the Literal takes no "8"
            raise ApiError(ErrorCode.invalid_request, f"kv_cache_bits must be one of {KV_BITS}, not {kv_cache_bits}")
        bits = cast(KvCacheBits | None, kv_cache_bits) if kv_cache_bits is not None else node.settings.kv_cache_bits
        sizing = KvSizing(kv_cache_gb=kv_cache_gb, max_context=max_context, kv_cache_bits=bits)
        found = skulk_previews(node.state, card, shardings, metas, set(excluded_node_ids), engine, sizing)
        wanted = ModelId(model_id)
        downloads = {n: d[wanted].model_dump(mode="json") for n, d in node.state.downloads.items() if wanted in d}
        return {"previews": [p.model_dump(mode="json") for p in found], "downloads": downloads}

    @router.get("/instance/{instance_id}", response_model=None, responses=documented(InstanceView, 404))
    async def get_instance(instance_id: str) -> dict[str, Any]:
        instance = node.state.instances.get(InstanceId(instance_id))
        if instance is None:
            raise ApiError(ErrorCode.not_found, f"no instance {instance_id}; GET /state lists the instances")
        return instance.model_dump(mode="json")

    @router.delete("/instance/{instance_id}", response_model=None, responses=documented(DeletedInstance, 404))
    async def delete_instance(instance_id: str) -> dict[str, Any]:
        if InstanceId(instance_id) not in node.state.instances:
            raise ApiError(ErrorCode.not_found, f"no instance {instance_id}; GET /state lists the instances")
        command_id = CommandId(new_id())
        node.send_command(DeleteInstance(command_id=command_id, instance_id=InstanceId(instance_id)))
        await node.wait_for_state(lambda s: instance_id not in s.instances, PLACED_WAIT_S)
        return {"message": "Command received.", "commandId": command_id, "instanceId": instance_id}

    @router.post("/v1/cancel/{command_id}", response_model=None, responses=documented(CancelRequested, 404))
    async def cancel(command_id: str) -> dict[str, Any]:
        if not any(t.command_id == command_id and t.task_status.is_open for t in node.state.tasks.values()):
            raise ApiError(ErrorCode.not_found, f"no running request with command id {command_id}")
        OWNERS.check_cancel(command_id)
        node.send_command(
            CancelCommand(command_id=CommandId(new_id()), target_command_id=CommandId(command_id))
        )
        return {"message": "Cancel requested.", "commandId": command_id}

    return router
