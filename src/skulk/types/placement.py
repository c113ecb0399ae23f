"""Why a placement was refused, and what each candidate placement would look like.

Every refusal is its own class so the API can switch on the tag, answer with `http_status`, and show
`message` (which always says what the operator can do about it) without re-deriving anything.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Discriminator, Field, Tag, model_validator

from .backends import INSTALL, BackendTag, EngineChoice, EngineName, allows
from .base import CamelModel, TaggedModel, tag_of
from .errors import ErrorCode
from .ids import ModelId, NodeId
from .instances import InstanceMeta, Sharding
from .memory import GB, Memory
from .models import KvCacheBits


def _gb(memory: Memory) -> str:
    """GB with two decimals: the unit the runbook's 400 messages use."""
    return f"{memory.in_bytes / GB:.2f} GB"


def _ids(node_ids: list[NodeId]) -> str:
    return ", ".join(node_ids) if node_ids else "(none)"


KvCacheGb = Annotated[float, Field(gt=0, le=65536)]
"""kv_cache_gb: an instance's KV block pool in GiB, all ranks together (each rank holds its layers' or heads' share).
Unset: the card's kv_cache_gb, else kv_pools.DEFAULT_KV_FRACTION of what each node has free after the weights."""
MaxContext = Annotated[int, Field(ge=2, le=1 << 24)]
"""max_context: the longest context (prompt plus generation) an instance admits, capped by the model's own
(max_position_embeddings). Unset: the model's own."""


class KvSizing(CamelModel):
    """A placement's knobs on the KV cache, as a placement request or a MetaInstance carries them. kv_cache_bits:
    16, 8 or 4 (models.KvCacheBits; None: the card's, else 16)."""

    kv_cache_gb: KvCacheGb | None = None
    max_context: MaxContext | None = None
    kv_cache_bits: KvCacheBits | None = None


class PlacementError(TaggedModel):
    """Base of every refusal. `message` is derived from the fields unless given (e.g. when read back)."""

    message: str = ""
    http_status: int = 400

    @model_validator(mode="after")
    def _fill_message(self) -> Self:
        if not self.message:
            # Frozen model: set the derived field once, at construction, the only time it can change.
            object.__setattr__(self, "message", self.describe())
        return self

    def describe(self) -> str:
        raise NotImplementedError

    @property
    def code(self) -> ErrorCode:
        """The refusal's code: its class name (ErrorCode keeps `http_status` and the code's status equal)."""
        return ErrorCode(type(self).__name__)


class InsufficientMemory(PlacementError):
    """One node of the best candidate cannot hold its shard; memory is checked per node, never summed."""

    node_id: NodeId
    node_name: str | None = None
    node_ids: list[NodeId]
    sharding: Sharding
    needed: Memory
    weights_share: Memory
    overhead_factor: float
    runtime_overhead: Memory | None = None
    """The runner's runtime bytes beside weights_share x overhead_factor (the node's measured figure, else
    engines/footprint's 576 MiB ceiling; the factor is 1 for exact per-layer weights, 1.05 for an estimate). None
    only in a refusal from an older node, whose estimate was weights x 1.25."""
    kv_pool: Memory
    """This rank's KV block pool (its layers' or heads' share of the instance's pool)."""
    available: Memory
    draft: Memory | None = None
    """The card's draft model on this rank (its weights with overhead, and its KV), when it has one."""
    limit: Memory | None = None
    """The node's memory limit (its ramTotal), which `available` is counted under."""
    limit_source: str | None = None
    """Where that limit came from (machine, cgroup v1/v2, gpu working set, --memory-limit)."""

    def describe(self) -> str:
        name = f"{self.node_id} ({self.node_name})" if self.node_name else self.node_id
        draft = f" + {_gb(self.draft)} draft model" if self.draft else ""
        limit = f" under its {_gb(self.limit)} limit ({self.limit_source})" if self.limit and self.limit_source \
            else ""
        runtime = f" + {_gb(self.runtime_overhead)} runtime" if self.runtime_overhead else ""
        share = "" if self.overhead_factor == 1 else f" share × {self.overhead_factor:g}"  # noqa: RUF001
        return (
            f"node {name} needs {_gb(self.needed)} ({_gb(self.weights_share)} weights{share}{runtime} + "
            f"{_gb(self.kv_pool)} KV pool{draft}) but has "
            f"{_gb(self.available)} free{limit} ({self.sharding.value} over {len(self.node_ids)} node(s); weights and "
            "KV pool must fit strictly below free memory). Use a smaller model or a more aggressive quant, lower "
            "kv_cache_gb or max_context (the pool holds at least one request of the whole context), add nodes so "
            f"the per-node share shrinks, or free memory on node {name} and retry."
        )


class KvPoolTooSmall(PlacementError):
    """An explicit kv_cache_gb cannot hold one request of the whole context: such a request could never run."""

    model_id: ModelId
    kv_cache_gb: float
    pool_tokens: int
    context_length: int
    least: Memory
    """The smallest pool that holds one request of the whole context."""

    def describe(self) -> str:
        return (
            f"kv_cache_gb {self.kv_cache_gb:g} holds {self.pool_tokens} tokens of {self.model_id}'s KV cache, "
            f"fewer than one request of its context ({self.context_length} tokens) needs. Raise kv_cache_gb to at "
            f"least {self.least.in_bytes / GB:.3f}, or lower max_context to at most {self.pool_tokens}."
        )


class NoConnectedCycle(PlacementError):
    """No ring of at least min_nodes nodes exists among the nodes that are not excluded."""

    min_nodes: int
    connected_nodes: int
    available_nodes: int
    max_cycle_nodes: int

    def describe(self) -> str:
        cap = (
            f" Placement considers rings of at most {self.max_cycle_nodes} nodes."
            if self.min_nodes > self.max_cycle_nodes
            else ""
        )
        return (
            f"no connected cycle of at least {self.min_nodes} node(s): the largest ring has "
            f"{self.connected_nodes} of {self.available_nodes} available node(s). Check the links "
            "between nodes (each node in a ring must reach the next, and two nodes must reach each "
            f"other) or lower min_nodes.{cap}"
        )


class AllCandidatesExcluded(PlacementError):
    """Rings of min_nodes exist, but every one of them contains an excluded node."""

    excluded_node_ids: list[NodeId]
    min_nodes: int

    def describe(self) -> str:
        return (
            f"every candidate of at least {self.min_nodes} node(s) contains an excluded node "
            f"(excluded: {_ids(self.excluded_node_ids)}). Remove nodes from excluded_nodes; node ids "
            "are per-session, so re-read current ids from GET /state."
        )


TensorRefusal = Literal["model_unsupported", "attention_heads_not_divisible", "kv_heads_not_divisible"]


class TensorNotSupported(PlacementError):
    """Tensor sharding cannot split this model over this many nodes (or at all)."""

    reason: TensorRefusal
    model_id: ModelId
    node_count: int | None = None
    num_attention_heads: int
    num_key_value_heads: int

    def describe(self) -> str:
        if self.reason == "model_unsupported":
            return f"model {self.model_id} does not support Tensor sharding; use Pipeline sharding."
        return (
            f"Tensor sharding over {self.node_count} nodes needs num_attention_heads "
            f"({self.num_attention_heads}) and num_key_value_heads ({self.num_key_value_heads}) divisible "
            f"by {self.node_count}; use a node count that divides both, or Pipeline sharding."
        )


class InstanceKindUnsupported(PlacementError):
    """The requested instance kind cannot run on this build."""

    instance_meta: InstanceMeta
    supported: list[InstanceMeta] = [InstanceMeta.MlxRing]

    def describe(self) -> str:
        return (
            f"{self.instance_meta.value} instances (RDMA over Thunderbolt 5, macOS only) are not available on "
            f"this build; use {InstanceMeta.MlxRing.value} (TCP ring: MLX's ring backend or torch's group)."
        )


class EngineUnavailable(PlacementError):
    """A node of the ring cannot run the engine the placement needs (it lacks it, or the model's
    compatible_backends exclude what it has)."""

    node_id: NodeId
    node_name: str | None = None
    engine: EngineName
    requested: EngineChoice
    advertised: list[BackendTag]
    model_id: ModelId
    compatible_backends: list[BackendTag] | None = None
    detail: str | None = None
    """Every node has the engine, but it cannot split this model over the ring (say how instead)."""

    def describe(self) -> str:
        if self.detail is not None:
            return self.detail
        name = f"{self.node_id} ({self.node_name})" if self.node_name else self.node_id
        have = ", ".join(self.advertised) or "nothing"
        if self.compatible_backends is not None and not any(
            t in self.compatible_backends for t in self.advertised if t.split("-", 1)[0] == self.engine
        ) and any(t.split("-", 1)[0] == self.engine for t in self.advertised):
            return (
                f"node {name} runs {have}, but model {self.model_id} is compatible only with "
                f"{', '.join(self.compatible_backends)}; place it on nodes with one of those backends."
            )
        other = "torch" if self.engine == "mlx" else "mlx"
        instead = f", place with engine {other}," if allows(self.compatible_backends, other) else ""
        return (
            f"node {name} cannot run the {self.engine} engine for model {self.model_id} (it advertises: {have}; "
            f"engine requested: {self.requested}). Install it on that node ({INSTALL[self.engine]}) and restart "
            f"the node{instead} or exclude the node."
        )


class NotEnoughLayers(PlacementError):
    """Pipeline needs at least one layer per node."""

    model_id: ModelId
    n_layers: int
    node_count: int

    def describe(self) -> str:
        return (
            f"model {self.model_id} has {self.n_layers} layer(s) but the ring has {self.node_count} nodes; "
            "Pipeline gives every node at least one layer. Use fewer nodes."
        )


class SingleNodeOnly(PlacementError):
    """An embedding model runs whole on one node: its encoder is small and a request is one forward, so
    splitting it would only add network hops."""

    model_id: ModelId
    node_count: int

    def describe(self) -> str:
        return (
            f"model {self.model_id} is an embedding model and runs on one node, not {self.node_count}; "
            "place it with min_nodes 1."
        )


class InfoPending(PlacementError):
    """Memory info of some candidate nodes has not arrived yet; retrying shortly usually succeeds."""

    http_status: int = 503
    node_ids: list[NodeId]

    def describe(self) -> str:
        return (
            f"memory info is still arriving from node(s) {_ids(self.node_ids)}; wait a few seconds and retry."
        )


AnyPlacementError = Annotated[
    Annotated[InsufficientMemory, Tag("InsufficientMemory")]
    | Annotated[NoConnectedCycle, Tag("NoConnectedCycle")]
    | Annotated[AllCandidatesExcluded, Tag("AllCandidatesExcluded")]
    | Annotated[TensorNotSupported, Tag("TensorNotSupported")]
    | Annotated[InstanceKindUnsupported, Tag("InstanceKindUnsupported")]
    | Annotated[EngineUnavailable, Tag("EngineUnavailable")]
    | Annotated[NotEnoughLayers, Tag("NotEnoughLayers")]
    | Annotated[SingleNodeOnly, Tag("SingleNodeOnly")]
    | Annotated[InfoPending, Tag("InfoPending")]
    | Annotated[KvPoolTooSmall, Tag("KvPoolTooSmall")],
    Discriminator(tag_of),
]
"""For pydantic fields that hold any refusal; use the base `PlacementError` for isinstance checks."""


class PreviewNode(CamelModel):
    """One rank of a candidate: its layers and its memory before and after loading."""

    node_id: NodeId
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    needed: Memory
    free: Memory
    left_after: Memory
    kv_pool: Memory = Memory()
    """This rank's KV block pool, part of `needed` (with its linear-attention and SSM layers' stream states)."""
    weights: Memory = Memory()
    """This rank's weight bytes before runtime overhead, part of `needed`: its own layers' real bytes, the
    embedding on the first rank and the head on the last, where the card carries per-layer memory; else its
    layers' share of storage_size."""
    runtime: Memory = Memory()
    """The runner's runtime overhead counted for this rank, part of `needed`: what this node's runners of that
    engine and role measured they hold besides weights and KV (types/node_info.RunnerOverhead), or the default
    ceiling (engines/footprint.RUNTIME_OVERHEAD_BYTES) until one has."""
    runtime_measured: bool = False
    """Whether `runtime` is this node's measured figure (else the default)."""
    engine: EngineName = "torch"
    """The engine this rank would run (placement's choice for the ring)."""
    modeling: Literal["native", "transformers"] = "native"
    """Whose model code the rank runs: the engine's own ("native": the torch engine's files, mlx-lm's modules) or
    transformers' (the torch engine's slower fallback for a family it has no file for, ModelCard.torch_runtime)."""


class PlacementPreview(CamelModel):
    """One candidate ring (node_ids in rank order) with its plan, or the reason it cannot be placed."""

    model_id: ModelId
    sharding: Sharding
    instance_meta: InstanceMeta
    node_ids: list[NodeId]
    nodes: list[PreviewNode] = []
    context_length: int | None = None
    """The context the instance would admit (None: refused before it was worked out)."""
    error: AnyPlacementError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
