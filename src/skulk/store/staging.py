"""Pure decisions about a node's model files: where a shard loads from, which files it needs, and which
instances may start (every node of an instance has its files)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from skulk.config import Settings
from skulk.types.downloads import DownloadStatus
from skulk.types.ids import ModelId, NodeId
from skulk.types.instances import MlxRingInstance
from skulk.types.shards import PipelineShardMetadata, ShardMetadata
from skulk.types.state import State


class Route(StrEnum):
    Builtin = "builtin"
    """Generated locally by the runner; nothing to fetch."""
    LocalStore = "local_store"
    """A complete copy in this node's store_path: load it in place."""
    FromStore = "from_store"
    """Stage the shard's files from the LAN store host (Hugging Face if the store lacks it and fallback is on)."""
    FromHub = "from_hub"
    """No store (or this node is the store host): download the whole model into store_path."""
    ShardFromHub = "shard_from_hub"
    """No store, a pipeline rank holding part of the layers: download only the files that hold them (and the
    small ones) from Hugging Face into the staging root, as a rank staged from a store host gets them."""


@dataclass(frozen=True)
class Need:
    model_id: ModelId
    layers: tuple[int, int, int] | None
    """(start, end, n_layers) of a pipeline shard; None: every layer (tensor sharding, or the whole model)."""

    @property
    def partial(self) -> bool:
        """A pipeline stage short of the whole model: it needs only some of the weight files."""
        return self.layers is not None and (self.layers[0], self.layers[1]) != (0, self.layers[2])


def my_needs(state: State, node_id: NodeId) -> dict[ModelId, Need]:
    """The models this node's shards need, with the layer range of a pipeline shard."""
    needs: dict[ModelId, Need] = {}
    for instance in state.instances.values():
        shard = _my_shard(instance, node_id)
        if shard is None or shard.model_card.builtin:
            continue
        layers = (shard.start_layer, shard.end_layer, shard.n_layers)
        pipeline = isinstance(shard, PipelineShardMetadata)
        needs[instance.model_id] = Need(instance.model_id, layers if pipeline else None)
    return needs


def _my_shard(instance: MlxRingInstance, node_id: NodeId) -> ShardMetadata | None:
    runner = instance.shard_assignments.node_to_runner.get(node_id)
    return instance.shard_assignments.runner_to_shard.get(runner) if runner is not None else None


def in_use(state: State, node_id: NodeId) -> set[str]:
    """Models a live runner of this node uses, companions included: a model's draft model (its card's
    draft_model, which a single-rank runner loads beside it) is never evicted from under it."""
    used: set[str] = set()
    for instance in state.instances.values():
        shard = _my_shard(instance, node_id)
        if shard is not None:
            used.add(instance.model_id)
            if shard.model_card.draft_model is not None:
                used.add(shard.model_card.draft_model)
    return used


def route(settings: Settings, store_copy_complete: bool, *, shard_only: bool = False) -> Route:
    """With a store host configured, every other node stages from it (its own store_path is not a store);
    the store host, or a node without a store, loads its store_path copy when it is complete. Else the store
    host downloads the whole model into it (it serves every rank), and a node without a store downloads the
    whole model only when its shard needs every layer; shard_only (a partial pipeline stage, with a staging root
    apart from store_path) downloads just that stage's files into staging, never a partial copy in store_path."""
    store = settings.model_store
    if store.enabled and store.store_host and not settings.is_store_host:
        return Route.FromStore
    if store_copy_complete:
        return Route.LocalStore
    return Route.ShardFromHub if shard_only and not settings.is_store_host else Route.FromHub


def files_ready(state: State, instance: MlxRingInstance) -> bool:
    """Every node of the instance reported its files complete (built-in models need none)."""
    card = next(iter(instance.shard_assignments.runner_to_shard.values())).model_card
    if card.builtin:
        return True
    for node in instance.shard_assignments.node_to_runner:
        progress = state.downloads.get(node, {}).get(instance.model_id)
        if progress is None or progress.status != DownloadStatus.Completed:
            return False
    return True


def startable(state: State, ready_here: Callable[[MlxRingInstance], bool] = lambda _: True) -> State:
    """The state the worker plans from: instances whose files are not everywhere yet are held back, so no rank
    starts (and waits at the group rendezvous) before every rank can load; ready_here is this node's own word
    on its files (ModelFiles.ready)."""
    held = [iid for iid, inst in state.instances.items() if not (files_ready(state, inst) and ready_here(inst))]
    if not held:
        return state
    return state.model_copy(update={"instances": {k: v for k, v in state.instances.items() if k not in held}})
