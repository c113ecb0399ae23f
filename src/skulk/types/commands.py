"""Commands: imperative requests to the master, which validates them and answers with events."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, JsonValue, Tag

from .backends import EngineChoice
from .base import TaggedModel, tag_of
from .ids import CommandId, InstanceId, MetaInstanceId, ModelId, NodeId
from .instances import Instance, InstanceMeta, Sharding
from .meta_instances import MetaInstance
from .models import KvCacheBits, ModelCard
from .placement import KvCacheGb, KvSizing, MaxContext


class CreateInstance(TaggedModel):
    """Place an instance the API already planned against the same state the master holds."""

    command_id: CommandId
    instance: Instance


class DeleteInstance(TaggedModel):
    command_id: CommandId
    instance_id: InstanceId


class StartChatCompletion(TaggedModel):
    """Ask the master for a task. No prompt: the payload stays on origin_node_id, which serves it point to
    point to the nodes that run the task."""

    command_id: CommandId
    model: ModelId
    origin_node_id: NodeId | None = None
    instance_id: InstanceId | None = None


class StartEmbedding(TaggedModel):
    """Ask the master for an embedding task; like StartChatCompletion, the texts stay on origin_node_id."""

    command_id: CommandId
    model: ModelId
    origin_node_id: NodeId | None = None
    instance_id: InstanceId | None = None


class CancelCommand(TaggedModel):
    command_id: CommandId
    target_command_id: CommandId


class CreateMetaInstance(TaggedModel):
    command_id: CommandId
    meta_instance: MetaInstance
    first_node_ids: list[NodeId] | None = None
    """Place the first instance on exactly these nodes (what a dashboard preview showed) when they fit; later
    placements follow the MetaInstance's own constraint."""


class DeleteMetaInstance(TaggedModel):
    """Cascades in the master, in one batch: cancel the backing instances' open tasks, delete them, then it."""

    command_id: CommandId
    meta_instance_id: MetaInstanceId


class AddModelCard(TaggedModel):
    """A card built on one node (POST /models/add) made known to every node, the master included."""

    command_id: CommandId
    card: ModelCard


class PlaceInstance(TaggedModel):
    """Place a model now; the master decides, against its own state and the instances it already committed.

    instance_id is chosen by the API so it can answer with it; the master's verdict (the instance in state, or a
    typed refusal on the command's data key) reaches the API node."""

    command_id: CommandId
    instance_id: InstanceId
    model_id: ModelId
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    engine: EngineChoice = "auto"
    min_nodes: int = 1
    excluded_nodes: list[NodeId] = []
    model_card: ModelCard | None = None
    """The card as the API node knows it (a model added on that node may be unknown to the master's catalog)."""
    kv_cache_gb: KvCacheGb | None = None
    max_context: MaxContext | None = None
    kv_cache_bits: KvCacheBits | None = None

    @property
    def sizing(self) -> KvSizing:
        return KvSizing(kv_cache_gb=self.kv_cache_gb, max_context=self.max_context, kv_cache_bits=self.kv_cache_bits)


class SetTracingEnabled(TaggedModel):
    """Turn runtime tracing on or off cluster-wide; tasks created from then on carry the flag (runbook 004)."""

    command_id: CommandId
    enabled: bool


class RestartNode(TaggedModel):
    """POST /admin/restart?node_id=… for another node: that node replaces its process image in place."""

    command_id: CommandId
    node_id: NodeId


class OfferDesiredState(TaggedModel):
    """A follower's saved desired state (`<home>/desired.json` as it read it at start), offered to the first
    master of a restarted cluster, which restores what its own copy lacked (state/desired_offer.py).

    `saved` is the file's JSON object as it is, unvalidated on purpose: the master validates it entry by entry,
    as a node does its own file, so one bad entry costs that entry and never the offer (or the master)."""

    command_id: CommandId
    origin: NodeId
    saved: dict[str, JsonValue]


Command = Annotated[
    Annotated[CreateInstance, Tag("CreateInstance")]
    | Annotated[DeleteInstance, Tag("DeleteInstance")]
    | Annotated[StartChatCompletion, Tag("StartChatCompletion")]
    | Annotated[StartEmbedding, Tag("StartEmbedding")]
    | Annotated[CancelCommand, Tag("CancelCommand")]
    | Annotated[CreateMetaInstance, Tag("CreateMetaInstance")]
    | Annotated[DeleteMetaInstance, Tag("DeleteMetaInstance")]
    | Annotated[PlaceInstance, Tag("PlaceInstance")]
    | Annotated[AddModelCard, Tag("AddModelCard")]
    | Annotated[SetTracingEnabled, Tag("SetTracingEnabled")]
    | Annotated[RestartNode, Tag("RestartNode")]
    | Annotated[OfferDesiredState, Tag("OfferDesiredState")],
    Discriminator(tag_of),
]


class ForwardedCommand(TaggedModel):
    """A command on its way to the master. (master, term) is the master it is addressed to: any other master
    refuses it, so a sealed copy captured before a failover cannot be replayed to the next master (issue 27)."""

    origin: NodeId
    command: Command
    term: int = 0
    master: NodeId | None = None
