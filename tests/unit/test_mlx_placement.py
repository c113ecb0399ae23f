"""Placement counts the bytes each rank's engine loads: an MLX rank serving a GGUF import loads its bf16 export
(card.mlx_storage_size, about 3.5x a 4-bit file), a torch rank the file; an mlx-community quantized checkpoint
is its files on either engine. Pure functions, plus the preview a client reads over HTTP."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from skulk.api.app import create_app
from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES, resident_bound
from skulk.master.placement import place, preview_placements
from skulk.master.reconcile import with_committed
from skulk.master.shard_plan import loaded_bytes, plan_ring
from skulk.models.cards import get_card
from skulk.types.backends import BackendTag, EngineChoice
from skulk.types.ids import InstanceId, NodeId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from skulk.types.placement import InsufficientMemory, PlacementError
from skulk.types.state import State
from tests.unit.factories import api_services
from tests.unit.test_placement import N_LAYERS, WEIGHTS, card, runner_ids, state

pytestmark = pytest.mark.timeout(60)

EXPORT = 3 * WEIGHTS
MLX_NODE: list[BackendTag] = ["torch", "torch-cpu", "mlx", "mlx-cpu"]
GGUF = card(quantization="4", mlx_storage_size=Memory.from_bytes(EXPORT))
MLX_COMMUNITY = card(quantization="4")


def test_each_engine_loads_its_own_bytes() -> None:
    assert loaded_bytes(GGUF, "torch") == WEIGHTS  # the torch engine reads the GGUF file's blocks
    assert loaded_bytes(GGUF, "mlx") == EXPORT  # mlx-lm reads the bf16 export
    assert loaded_bytes(MLX_COMMUNITY, "mlx") == loaded_bytes(MLX_COMMUNITY, "torch") == WEIGHTS


def test_a_mixed_pipeline_gives_the_mlx_rank_its_export_share_and_fewer_layers() -> None:
    """Equal free memory: the MLX rank's layers cost 3x, so it takes fewer of them, and its share is of the
    export; a ring of one engine splits as before."""
    free = [1 << 30, 1 << 30]
    torch_rank, mlx_rank = plan_ring(GGUF, Sharding.Pipeline, [NodeId("a"), NodeId("b")], free,
                                     engines=["torch", "mlx"])
    assert mlx_rank.end_layer - mlx_rank.start_layer == N_LAYERS // 4  # capacity 1 : 3
    assert mlx_rank.weights_share == EXPORT * (N_LAYERS // 4) // N_LAYERS
    assert torch_rank.weights_share == WEIGHTS * (3 * N_LAYERS // 4) // N_LAYERS
    plain = plan_ring(GGUF, Sharding.Pipeline, [NodeId("a"), NodeId("b")], free)
    assert [p.end_layer - p.start_layer for p in plain] == [N_LAYERS // 2] * 2
    tensor = plan_ring(GGUF, Sharding.Tensor, [NodeId("a"), NodeId("b")], free, engines=["mlx", "mlx"])
    assert [p.weights_share for p in tensor] == [EXPORT // 2] * 2


def _place(s: State, engine: EngineChoice, c: ModelCard = GGUF) -> MlxRingInstance | PlacementError:
    return place(s, c, Sharding.Pipeline, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                 new_runner_id=runner_ids(), rendezvous_port=29500, engine=engine)


def test_a_node_that_holds_the_gguf_file_but_not_its_export_refuses_mlx_only() -> None:
    """Room for the file (and a small KV pool), not for the export: torch places, mlx is InsufficientMemory
    quoting the export's bytes; the same node places an mlx-community checkpoint of the file's size on MLX."""
    s = state({"a": 2 * WEIGHTS + RUNTIME_OVERHEAD_BYTES}).model_copy(update={"node_backends": {NodeId("a"): MLX_NODE}})
    assert isinstance(_place(s, "torch"), MlxRingInstance)
    refused = _place(s, "mlx")
    assert isinstance(refused, InsufficientMemory) and refused.weights_share.in_bytes == EXPORT
    assert isinstance(_place(s, "mlx", MLX_COMMUNITY), MlxRingInstance)
    previews = preview_placements(s, GGUF, Sharding.Pipeline, InstanceMeta.MlxRing, engine="mlx")
    assert [type(p.error) for p in previews] == [InsufficientMemory]


def test_memory_committed_to_an_mlx_rank_not_yet_loaded_is_its_export() -> None:
    s = state({"a": 1 << 30}).model_copy(update={"node_backends": {NodeId("a"): MLX_NODE}})
    for engine, weights in (("torch", WEIGHTS), ("mlx", EXPORT)):
        placed = _place(s, engine)  # type: ignore[arg-type]
        assert isinstance(placed, MlxRingInstance) and placed.engine == engine
        pool = placed.kv_cache_bytes[next(iter(placed.kv_cache_bytes))]
        committed = with_committed(s.model_copy(update={"instances": {placed.instance_id: placed}}))
        assert committed.node_memory[NodeId("a")].ram_available.in_bytes == (1 << 30) - weights - pool


def test_the_preview_over_http_counts_the_packaged_ggufs_export_for_an_mlx_rank() -> None:
    """GET /instance/previews for the packaged SmolLM2 (a Q4_1 GGUF, 98 MB; its bf16 export 269 MB): the
    memory delta on an MLX node is the export's, on torch the file's."""
    smollm2 = get_card("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smollm2 is not None and smollm2.mlx_storage_size is not None
    s = state({"a": 1 << 36}).model_copy(update={"node_backends": {NodeId("a"): MLX_NODE}})
    client = TestClient(create_app(api_services(state=s, node_id="a", master="a")), base_url="http://127.0.0.1")
    delta: dict[str, int] = {}
    for engine in ("torch", "mlx"):
        got = client.get("/instance/previews", params={"model_id": smollm2.model_id, "engine": engine,
                                                       "sharding": "Pipeline", "instance_meta": "MlxRing"})
        assert got.status_code == 200, got.text
        (preview,) = got.json()["previews"]
        delta[engine] = preview["memory_delta_by_node"]["a"]
    assert delta["mlx"] - delta["torch"] == (resident_bound(smollm2.mlx_storage_size.in_bytes)
                                             - resident_bound(smollm2.storage_size.in_bytes))
    assert smollm2.mlx_storage_size.in_bytes > 2.5 * smollm2.storage_size.in_bytes
