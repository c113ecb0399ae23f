"""KV cache in 8 and 4 bits (issue 41): the quantizer's error bounds, the engine's quantized pools, and placement
counting the smaller bytes a position costs (so more context fits).

The placement card is test_placement's small model: 8 layers, 2 KV heads of 16, bf16. A position costs per head
32 bytes of keys (or values) at 16 bits, 16 + 2 (int8 and its float16 scale) at 8, 8 + 2 (int4, one group of 16
and its scale) at 4: 1024, 576 and 320 bytes a position over the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skulk.config import ConfigError, Settings, resolve
from skulk.engines.footprint import resident_bound
from skulk.engines.kv_pools import int4_group, kv_head_bytes
from skulk.engines.torch import kv_quant
from skulk.engines.torch.cache import KVCache, LayerCache, QuantizedLayerCache, StepBatch
from skulk.engines.torch.core import kv_bits_or_default
from skulk.master.placement import place, preview_placements
from skulk.master.shard_plan import kv_bytes_per_token
from skulk.state.desired import desired_of
from skulk.types.backends import BackendTag, EngineChoice
from skulk.types.ids import InstanceId, MetaInstanceId, ModelId, NodeId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import GB
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import ModelCard
from skulk.types.placement import EngineUnavailable, InsufficientMemory, KvPoolTooSmall, KvSizing, PlacementError
from skulk.types.state import State

from .test_placement import WEIGHTS, card, runner_ids, state

pytestmark = pytest.mark.timeout(60)

PER_TOKEN = {16: 1024, 8: 576, 4: 320}
BASE = resident_bound(WEIGHTS)
MLX_NODE: list[BackendTag] = ["torch", "torch-cpu", "mlx", "mlx-cpu"]


# --- quantize / dequantize ----------------------------------------------------------------------------------


def _heads(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Keys-like values: unit noise with a few large outliers per head, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 20
    return x


@pytest.mark.parametrize(("bits", "levels"), [(8, 127), (4, 7)])
def test_a_round_trip_is_within_half_a_step_of_each_group(bits: int, levels: int) -> None:
    x = _heads((3, 4, 5, 64))
    data, scales = kv_quant.quantize(x, bits)
    assert data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert data.shape[-1] == kv_quant.packed_width(64, bits) and scales.dtype == torch.float16
    back = kv_quant.dequantize(data, scales, bits, torch.float32)
    groups = kv_quant.scale_groups(64, bits)
    amax = x.reshape(*x.shape[:-1], groups, -1).abs().amax(-1, keepdim=True)
    error = (back - x).abs().reshape((*amax.shape[:-1], -1))
    bound = amax / (2 * levels) * (1 + 2**-10)  # half a step, the float16 scale's own rounding on top
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # it does quantize


def test_int8_is_about_sixteen_times_finer_than_int4_and_zeros_stay_zeros() -> None:
    x = torch.randn((2, 2, 32, 128), generator=torch.Generator().manual_seed(1))
    err = {b: float((kv_quant.dequantize(*kv_quant.quantize(x, b), b, torch.float32) - x).abs().mean()) for b in (8, 4)}
    assert 10 < err[4] / err[8] < 25
    zeros = torch.zeros(1, 1, 2, 16)
    for bits in (8, 4):
        assert torch.equal(kv_quant.dequantize(*kv_quant.quantize(zeros, bits), bits, torch.bfloat16),
                           zeros.bfloat16())


def test_int4_packs_two_values_a_byte_low_nibble_first() -> None:
    x = torch.tensor([[7.0, -7.0, 0.0, 3.0]])
    data, scales = kv_quant.quantize(x, 4)
    assert scales.tolist() == [[1.0]]
    assert data.tolist() == [[(7 + 8) | ((-7 + 8) << 4), 8 | ((3 + 8) << 4)]]


def test_bytes_a_position_costs_at_each_width() -> None:
    assert [kv_head_bytes(128, b, 2) for b in (16, 8, 4)] == [256, 130, 72]
    assert kv_head_bytes(64, 16, 4) == 256  # a float32 model's 16 is its own dtype
    assert int4_group(80) == 20 and kv_head_bytes(80, 4, 2) == 40 + 2 * 4
    with pytest.raises(ValueError, match="kv_cache_bits"):
        kv_head_bytes(64, 6, 2)


# --- the engine's pools ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_pool_costs_what_bytes_per_token_says(bits: int) -> None:
    cache = KVCache(3, num_blocks=5, n_kv_heads=2, block_size=8, head_dim=64, dtype=torch.bfloat16, bits=bits)
    assert all(isinstance(layer, QuantizedLayerCache) for layer in cache.layers)
    assert cache.nbytes == 5 * 8 * KVCache.bytes_per_token(3, 2, 64, torch.bfloat16, bits)
    assert KVCache.bytes_per_token(3, 2, 64, torch.bfloat16, bits) == 2 * 3 * 2 * kv_head_bytes(64, bits, 2)


@pytest.mark.parametrize(("bits", "tolerance"), [(8, 0.02), (4, 0.3)])
def test_a_quantized_layer_reads_back_what_the_float_one_holds(bits: int, tolerance: float) -> None:
    """Written through a block table, gathered and dequantized: the float layer's keys and values within the
    quantizer's step; a copied block brings its scales along."""
    shape = (6, 2, 4, 32)
    plain = LayerCache(shape, torch.float32, torch.device("cpu"))
    packed = QuantizedLayerCache(shape, torch.float32, torch.device("cpu"), bits)
    k, v = _heads((1, 2, 10, 32), seed=2), _heads((1, 2, 10, 32), seed=3)
    batch = StepBatch.build(torch.arange(10).view(1, 10), torch.tensor([[4, 1, 5]], dtype=torch.int32))
    want, got = plain.update(k, v, batch), packed.update(k, v, batch)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape == (1, 2, 10, 32)
        assert float((a - b).abs().max()) <= tolerance * float(a.abs().max())
    packed.copy_block(1, 0)
    moved = packed.gather(torch.tensor([[4, 0]], dtype=torch.int32), 8)
    assert torch.equal(moved[0], got[0][:, :, :8])


def test_the_engine_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKULK_KV_CACHE_BITS", raising=False)
    assert kv_bits_or_default(None) == 16 and kv_bits_or_default(4) == 4
    monkeypatch.setenv("SKULK_KV_CACHE_BITS", "8")
    assert kv_bits_or_default(None) == 8
    with pytest.raises(ValueError, match="kv_cache_bits"):
        kv_bits_or_default(5)


def test_the_node_setting_reads_skulk_kv_cache_bits(tmp_path: Path) -> None:
    assert Settings().kv_cache_bits is None
    env = {"SKULK_KV_CACHE_BITS": "4", "SKULK_HOME": str(tmp_path)}
    assert resolve({}, env).kv_cache_bits == 4
    with pytest.raises(ConfigError, match="kv_cache_bits"):
        resolve({}, {**env, "SKULK_KV_CACHE_BITS": "3"})


# --- placement ------------------------------------------------------------------------------------------------


def put(s: State, c: ModelCard | None = None, *, engine: EngineChoice = "auto",
        **sizing: object) -> MlxRingInstance | PlacementError:
    return place(s, c or card(), Sharding.Pipeline, InstanceMeta.MlxRing, instance_id=InstanceId("inst-1"),
                 new_runner_id=runner_ids(), rendezvous_port=29500, engine=engine,
                 sizing=KvSizing.model_validate(sizing))


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_placement_counts_the_bytes_a_position_costs_at_its_bits(bits: int) -> None:
    c = card(kv_cache_bits=bits)
    assert kv_bytes_per_token(c, 8) == PER_TOKEN[bits]
    assert kv_bytes_per_token(c, 8, tensor_ways=2) == PER_TOKEN[bits] // 2
    instance = put(state({"a": 1 << 40}), card(), kv_cache_bits=bits)
    assert isinstance(instance, MlxRingInstance)
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    assert (shard.model_card.kv_cache_bits or 16) == bits  # the runner builds its pools at these bits
    assert list(instance.kv_cache_bytes.values()) == [64 * 16 * PER_TOKEN[bits]]  # MAX_STREAMS whole contexts


def test_a_node_too_small_for_one_context_at_16_bits_holds_it_at_4() -> None:
    """65,536 positions cost 64 MiB at 16 bits and 20 MiB at 4: a node with 40 MiB beside its weights refuses the
    first and serves the second (its pool then one whole context)."""
    c = card(context_length=65536)
    s = state({"a": BASE + (40 << 20)})
    refused = put(s, c)
    assert isinstance(refused, InsufficientMemory)
    assert refused.kv_pool.in_bytes == 65536 * PER_TOKEN[16]
    placed = put(s, c, kv_cache_bits=4)
    assert isinstance(placed, MlxRingInstance), getattr(placed, "message", placed)
    assert list(placed.kv_cache_bytes.values()) == [65536 * PER_TOKEN[4]]
    eight = put(s, c, kv_cache_bits=8)  # 36 MiB: fits too
    assert isinstance(eight, MlxRingInstance)
    previews = preview_placements(s, c, Sharding.Pipeline, InstanceMeta.MlxRing,
                                  sizing=KvSizing(kv_cache_bits=4))
    assert previews[0].ok and previews[0].nodes[0].kv_pool.in_bytes == 65536 * PER_TOKEN[4]


def test_an_explicit_pool_holds_more_context_at_fewer_bits() -> None:
    c = card(context_length=65536)
    gb = (32 << 20) / GB  # 32,768 positions at 16 bits, 104,857 at 4
    too_small = put(state({"a": 1 << 40}), c, kv_cache_gb=gb)
    assert isinstance(too_small, KvPoolTooSmall) and too_small.pool_tokens == 32768
    placed = put(state({"a": 1 << 40}), c, kv_cache_gb=gb, kv_cache_bits=4)
    assert isinstance(placed, MlxRingInstance)
    assert sum(placed.kv_cache_bytes.values()) <= 32 << 20


def test_a_quantized_kv_cache_never_goes_to_an_mlx_rank() -> None:
    s = state({"a": 1 << 36}).model_copy(update={"node_backends": {NodeId("a"): MLX_NODE}})
    assert isinstance(put(s, engine="mlx"), MlxRingInstance)  # 16 bits: MLX may run it
    refused = put(s, engine="mlx", kv_cache_bits=8)
    assert isinstance(refused, EngineUnavailable)
    assert "kv_cache_bits 8" in refused.message and "mlx engine" in refused.message
    auto = put(s, kv_cache_bits=4)  # auto takes torch, which every node of the ring has
    assert isinstance(auto, MlxRingInstance) and auto.engine == "torch"


def test_a_meta_instance_keeps_its_bits_through_a_restart() -> None:
    meta = MetaInstance(meta_instance_id=MetaInstanceId("m"), model_id=ModelId("test/model"), kv_cache_bits=4)
    assert meta.sizing.kv_cache_bits == 4
    s = State(meta_instances={meta.meta_instance_id: meta})
    assert desired_of(s).meta_instances[meta.meta_instance_id].kv_cache_bits == 4
