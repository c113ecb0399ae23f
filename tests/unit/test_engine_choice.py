"""Choosing the engine in Skulk's vocabulary: nodes' backend tags, the card's compatible_backends (hard) and
backend_preference (soft), an explicit engine, typed refusals naming the node and what to install, previews
showing the engine per node, MetaInstances honouring it, and a node's own tags."""

from __future__ import annotations

import sys

import pytest

from skulk.master.engine_choice import choose_engine, instance_engine_error
from skulk.master.placement import place, preview_placements
from skulk.master.reconcile import matches
from skulk.types.backends import BackendTag, EngineChoice, engine_of
from skulk.types.ids import InstanceId, MetaInstanceId, ModelId, NodeId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import ModelCard
from skulk.types.node_info import NodeInfo
from skulk.types.placement import EngineUnavailable, InstanceKindUnsupported, PlacementError
from skulk.types.state import State
from tests.unit.test_placement import card, runner_ids, state

MAC: list[BackendTag] = ["torch", "torch-cpu", "mlx", "mlx-metal"]
LINUX_MLX: list[BackendTag] = ["torch", "torch-cpu", "mlx", "mlx-cpu"]
LINUX: list[BackendTag] = ["torch", "torch-cpu"]
BIG = 1 << 34


def cluster(**tags: list[BackendTag] | None) -> State:
    s = state(dict.fromkeys(tags, BIG))
    return s.model_copy(update={"node_backends": {NodeId(n): t for n, t in tags.items() if t is not None}})


def do_place(s: State, engine: EngineChoice = "auto", c: ModelCard | None = None, *, min_nodes: int = 1,
             meta: InstanceMeta = InstanceMeta.MlxRing) -> MlxRingInstance | PlacementError:
    return place(s, c or card(), Sharding.Pipeline, meta, instance_id=InstanceId("i"), new_runner_id=runner_ids(),
                 rendezvous_port=29500, min_nodes=min_nodes, engine=engine)


def test_tags_name_their_engine() -> None:
    assert [engine_of(t) for t in ("torch", "torch-cuda", "mlx", "mlx-metal", "llama_cpp-vulkan")] == [
        "torch", "torch", "mlx", "mlx", None]


@pytest.mark.parametrize(("tags", "engine"), [(MAC, "mlx"), (LINUX_MLX, "torch"), (LINUX, "torch"), (None, "torch")])
def test_auto_picks_mlx_on_metal_and_torch_elsewhere(tags: list[BackendTag] | None, engine: str) -> None:
    """None: a node that advertises nothing (an older build) runs torch."""
    placed = do_place(cluster(a=tags))
    assert isinstance(placed, MlxRingInstance) and placed.engine == engine


def test_auto_gives_each_node_its_best_engine_in_a_mixed_pipeline() -> None:
    """A Mac and a Linux box: auto runs MLX on the Mac beside torch on Linux in one Pipeline (the ranks speak
    torch's group wire); an explicit engine gives every rank that one engine."""
    both = cluster(a=MAC, b=LINUX_MLX)
    auto = do_place(both, min_nodes=2)
    assert isinstance(auto, MlxRingInstance) and auto.mixed
    assert auto.engine == "torch" and auto.engine_by_node == {"a": "mlx", "b": "torch"}
    assert auto.engines() == {"a": "mlx", "b": "torch"}
    for engine in ("mlx", "torch"):
        uniform = do_place(both, engine, min_nodes=2)
        assert isinstance(uniform, MlxRingInstance) and uniform.engine == engine and not uniform.mixed
        assert uniform.engine_by_node is None and set(uniform.engines().values()) == {engine}


def test_nodes_kept_to_one_engine_each_mix_in_a_pipeline_only() -> None:
    """SKULK_ENGINES=mlx on one node, torch on the other: no engine is common, so auto mixes them in a Pipeline;
    a Tensor instance cannot mix (an all_reduce in every layer) and is refused naming the node."""
    kept = cluster(a=["mlx", "mlx-cpu"], b=LINUX)
    auto = do_place(kept, min_nodes=2)
    assert isinstance(auto, MlxRingInstance) and auto.engine_by_node == {"a": "mlx", "b": "torch"}
    tensor = place(kept, card(), Sharding.Tensor, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                   new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=2)
    assert isinstance(tensor, EngineUnavailable) and tensor.node_id == "a" and tensor.http_status == 400
    gemma = do_place(kept, c=card(family="gemma3_text", mlx_splits=[]), min_nodes=2)
    assert isinstance(gemma, EngineUnavailable)  # mlx-lm cannot slice it: no MLX stage to mix in
    previews = preview_placements(kept, card(), Sharding.Pipeline, InstanceMeta.MlxRing)
    two = next(p for p in previews if len(p.node_ids) == 2)
    assert {n.node_id: n.engine for n in two.nodes} == {"a": "mlx", "b": "torch"}


def test_a_mixed_instance_given_whole_is_checked_per_node() -> None:
    c, backends = card(), {NodeId("a"): MAC, NodeId("b"): LINUX}
    mixed = {NodeId("a"): "mlx", NodeId("b"): "torch"}
    assert instance_engine_error(c, mixed, backends, sharding=Sharding.Pipeline) is None  # type: ignore[arg-type]
    wrong = instance_engine_error(c, {NodeId("a"): "torch", NodeId("b"): "mlx"}, backends, sharding=Sharding.Pipeline)
    assert wrong is not None and wrong.node_id == "b"
    tensor = instance_engine_error(c, mixed, backends, sharding=Sharding.Tensor)  # type: ignore[arg-type]
    assert tensor is not None and "Pipeline" in tensor.message


def test_a_meta_instance_for_one_engine_is_not_backed_by_a_mixed_instance() -> None:
    placed = do_place(cluster(a=MAC, b=LINUX), min_nodes=2)
    assert isinstance(placed, MlxRingInstance) and placed.mixed
    meta = MetaInstance(meta_instance_id=MetaInstanceId("m"), model_id=ModelId("test/model"))
    assert matches(meta, placed)
    assert not matches(meta.model_copy(update={"engine": "torch"}), placed)
    assert not matches(meta.model_copy(update={"engine": "mlx"}), placed)


def test_skulk_engines_keeps_a_node_to_the_engines_it_names() -> None:
    from skulk.worker import node_info

    assert node_info.backends(("torch",)) == [t for t in node_info.backends() if t.startswith("torch")]
    assert all(t.startswith("mlx") for t in node_info.backends(("mlx",)))


def test_explicit_mlx_skips_a_node_without_it_and_refuses_when_none_has_it() -> None:
    placed = do_place(cluster(a=LINUX, b=LINUX_MLX), "mlx")
    assert isinstance(placed, MlxRingInstance) and list(placed.shard_assignments.node_to_runner) == ["b"]
    refused = do_place(cluster(a=LINUX), "mlx")
    assert isinstance(refused, EngineUnavailable) and refused.http_status == 400
    assert refused.node_id == "a" and refused.advertised == LINUX
    assert "cannot run the mlx engine" in refused.message and "pip install 'mlx[cpu]' mlx-lm" in refused.message


def test_a_ring_of_two_refuses_naming_the_node_that_lacks_the_engine() -> None:
    refused = do_place(cluster(a=LINUX_MLX, b=LINUX), "mlx", min_nodes=2)
    assert isinstance(refused, EngineUnavailable) and refused.node_id == "b"


def test_compatible_backends_filter_and_preference_order() -> None:
    metal_only = card(compatible_backends=["mlx-metal"])
    placed = do_place(cluster(a=LINUX_MLX, b=MAC), c=metal_only)
    assert isinstance(placed, MlxRingInstance) and placed.engine == "mlx"
    assert list(placed.shard_assignments.node_to_runner) == ["b"]
    refused = do_place(cluster(a=LINUX_MLX), c=metal_only)
    assert isinstance(refused, EngineUnavailable) and "compatible only with mlx-metal" in refused.message
    prefers_mlx = do_place(cluster(a=LINUX_MLX), c=card(backend_preference=["mlx-cpu", "torch"]))
    assert isinstance(prefers_mlx, MlxRingInstance) and prefers_mlx.engine == "mlx"
    torch_only = do_place(cluster(a=MAC), c=card(compatible_backends=["torch", "torch-cpu"]))
    assert isinstance(torch_only, MlxRingInstance) and torch_only.engine == "torch"


def test_previews_show_the_engine_per_node_and_the_refusal_per_ring() -> None:
    s = cluster(a=MAC, b=LINUX)
    previews = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxRing, engine="mlx")
    by_ring = {tuple(map(str, p.node_ids)): p for p in previews}
    assert [n.engine for n in by_ring["a",].nodes] == ["mlx"]
    assert isinstance(by_ring["b",].error, EngineUnavailable)
    auto = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxRing)
    assert {tuple(map(str, p.node_ids)): [n.engine for n in p.nodes] for p in auto}["a",] == ["mlx"]


def test_jaccl_is_refused_with_a_400_that_says_why() -> None:
    refused = do_place(cluster(a=MAC), meta=InstanceMeta.MlxJaccl)
    assert isinstance(refused, InstanceKindUnsupported) and refused.http_status == 400
    assert "RDMA over Thunderbolt 5, macOS only" in refused.message


def test_an_instance_given_whole_is_checked_too() -> None:
    c = card()
    assert instance_engine_error(c, {NodeId("a"): "mlx"}, {NodeId("a"): MAC}) is None
    error = instance_engine_error(c, {NodeId("a"): "mlx"}, {NodeId("a"): LINUX})
    assert error is not None and error.node_id == "a"


def test_meta_instances_match_only_their_engine() -> None:
    placed = do_place(cluster(a=MAC))
    assert isinstance(placed, MlxRingInstance)
    meta = MetaInstance(meta_instance_id=MetaInstanceId("m"), model_id=ModelId("test/model"))
    assert matches(meta, placed)
    assert matches(meta.model_copy(update={"engine": "mlx"}), placed)
    assert not matches(meta.model_copy(update={"engine": "torch"}), placed)


def test_choose_engine_orders_auto_by_preference_then_metal() -> None:
    c = card()
    assert choose_engine(c, "auto", [NodeId("a"), NodeId("b")], {NodeId("a"): MAC, NodeId("b"): MAC}) == "mlx"
    assert choose_engine(c, "torch", [NodeId("a")], {NodeId("a"): MAC}) == "torch"


def test_node_info_carries_backends_into_state() -> None:
    from datetime import UTC, datetime

    from skulk.state.apply import apply
    from skulk.types.events import IndexedEvent, NodeGatheredInfo

    event = NodeGatheredInfo(node_id=NodeId("a"), info=NodeInfo(backends=MAC), when=datetime.now(UTC))
    assert apply(State(), IndexedEvent(idx=0, event=event)).node_backends == {"a": MAC}


@pytest.mark.slow  # probes MLX in a child interpreter (seconds)
def test_this_node_advertises_mlx_cpu_when_mlx_computes_here() -> None:
    from skulk.worker import node_info

    node_info.backends.cache_clear()
    tags = node_info.backends()
    assert tags[:2] == ["torch", "torch-cpu"]
    mlx_ok = pytest.importorskip("skulk.engines.mlx").available() is None  # this process, against the child's
    assert ("mlx" in tags) is mlx_ok
    if mlx_ok and sys.platform == "linux":
        assert "mlx-cpu" in tags and "mlx-metal" not in tags


def test_a_mac_reports_the_gpu_working_set_as_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS arm64: what an MLX rank can keep resident is Metal's recommended working set, not all of RAM."""
    from skulk.worker import node_info

    monkeypatch.setattr(node_info, "gpu_working_set", lambda: 1 << 20)
    usage = node_info.memory()
    assert usage.ram_total.in_bytes == 1 << 20 and usage.ram_available.in_bytes <= 1 << 20
    monkeypatch.setattr(node_info, "gpu_working_set", lambda: None)
    assert node_info.memory().ram_total.in_bytes > 1 << 20


def test_a_node_without_mlx_says_so_and_reports_only_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No wheels for this platform: absent, not broken (find_spec finds nothing, nothing is imported)."""
    import importlib.util

    from skulk.engines import mlx as mlx_engine
    from skulk.worker import node_info

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("mlx") else real(name))
    mlx_engine.probed.cache_clear()
    node_info.backends.cache_clear()
    try:
        assert mlx_engine.probe() == "mlx and mlx-lm are not installed"
        assert node_info.backends() == ["torch", "torch-cpu"]
    finally:
        mlx_engine.probed.cache_clear()
        node_info.backends.cache_clear()


def test_gguf_models_run_on_mlx_on_a_mac() -> None:
    """The packaged default (SmolLM2 as a GGUF file) and any imported GGUF: an MLX rank serves its bf16 export
    (models/gguf_export.py), so auto picks MLX on a Mac and torch stays allowed."""
    from skulk.models.cards import get_card
    from skulk.models.gguf_import import GGUF_BACKENDS

    smol = get_card("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol is not None and smol.compatible_backends == GGUF_BACKENDS
    placed = do_place(cluster(a=MAC), c=smol)
    assert isinstance(placed, MlxRingInstance) and placed.engine == "mlx"
    forced = do_place(cluster(a=MAC), "torch", c=smol)
    assert isinstance(forced, MlxRingInstance) and forced.engine == "torch"


def test_mlx_is_not_chosen_for_a_split_mlx_lm_cannot_run() -> None:
    """Gemma 3 (window layers indexed by position) is no Pipeline slice for mlx-lm and has no shard(): over two
    Macs auto runs it on torch, and engine mlx is a 400 that says how to place it instead; Llama splits either way."""
    macs = cluster(a=MAC, b=MAC)
    gemma = card(family="gemma3_text", mlx_splits=[])
    auto = do_place(macs, c=gemma, min_nodes=2)
    assert isinstance(auto, MlxRingInstance) and auto.engine == "torch"
    refused = do_place(macs, "mlx", c=gemma, min_nodes=2)
    assert isinstance(refused, EngineUnavailable) and "cannot split" in refused.message
    alone = do_place(macs, "mlx", c=gemma)
    assert isinstance(alone, MlxRingInstance) and alone.engine == "mlx"
    llama = place(macs, card(), Sharding.Tensor, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                  new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=2, engine="mlx")
    assert isinstance(llama, MlxRingInstance) and llama.engine == "mlx"


def test_mlx_splits_come_from_the_card_and_an_old_card_is_judged_by_its_layers() -> None:
    """A card that read mlx-lm's module says which splits it has (Qwen3-Next: Pipeline only, no shard()). A card
    from an older build read nothing: Pipeline where every layer is alike, never Tensor (it says to add the model
    again), and no Pipeline for a stack that mixes window layers."""
    macs = cluster(a=MAC, b=MAC)
    nxt = card(family="qwen3_next", mlx_splits=["Pipeline"])
    assert do_place(macs, "mlx", c=nxt, min_nodes=2).engine == "mlx"  # type: ignore[union-attr]
    tensor = place(macs, nxt, Sharding.Tensor, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                   new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=2, engine="mlx")
    assert isinstance(tensor, EngineUnavailable) and "has no shard()" in tensor.message
    old = card(mlx_splits=None)
    assert do_place(macs, "mlx", c=old, min_nodes=2).engine == "mlx"  # type: ignore[union-attr]
    old_tensor = place(macs, old, Sharding.Tensor, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                       new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=2, engine="mlx")
    assert isinstance(old_tensor, EngineUnavailable) and "add the model again" in old_tensor.message
    windows = card(mlx_splits=None, sliding_layers=[0, 2])
    assert isinstance(do_place(macs, "mlx", c=windows, min_nodes=2), EngineUnavailable)


def test_a_family_torch_runs_through_transformers_is_not_mixed() -> None:
    """The mixed wire is TorchEngine's: a family the torch engine runs through transformers' modeling (its
    fallback speaks headers of its own) never shares an instance between MLX and torch ranks. Auto keeps every
    rank on one engine where the nodes share one, and refuses, naming the node, where they do not."""
    fallback = card(family="mixtral", torch_runtime="transformers", fallback_splits=True)
    both = do_place(cluster(a=MAC, b=LINUX_MLX), c=fallback, min_nodes=2)
    assert isinstance(both, MlxRingInstance) and not both.mixed and both.engine == "mlx"
    kept = do_place(cluster(a=["mlx", "mlx-cpu"], b=LINUX), c=fallback, min_nodes=2)
    assert isinstance(kept, EngineUnavailable) and kept.http_status == 400
    given = instance_engine_error(fallback, {NodeId("a"): "mlx", NodeId("b"): "torch"},
                                  {NodeId("a"): MAC, NodeId("b"): LINUX}, sharding=Sharding.Pipeline)
    assert given is not None and "natively" in given.message and "transformers" in given.message
    native = do_place(cluster(a=["mlx", "mlx-cpu"], b=LINUX), c=card(fallback_splits=True), min_nodes=2)
    assert isinstance(native, MlxRingInstance) and native.mixed  # the same ring mixes a native family
