"""Memory arithmetic per family (issue 40): each flagship's published config against hand-checked figures, and
placement's per-rank KV and weights summed from its own layers.

Every figure below is worked by hand in its comment from the config's dimensions (tests/unit/flagship_configs.py);
the parameter totals are the ones the model cards publish."""

from __future__ import annotations

from typing import Any

import pytest

from skulk.master.shard_plan import group_bytes_per_token, local_window, stream_state_bytes
from skulk.models.catalog import card_from_config
from skulk.models.memory_math import card_memory, memory_from_tensors, model_memory
from skulk.types.model_memory import ModelMemory
from skulk.types.models import ModelCard

from .flagship_configs import (
    DEEPSEEK_V3,
    GEMMA3_27B,
    GLM_45,
    GPT_OSS_120B,
    KIMI_K2,
    LLAMA4_MAVERICK,
    LLAMA4_SCOUT,
    MINIMAX_M2,
    MIXTRAL_8X7B,
    NEMOTRON_H_8B,
    QWEN3_235B,
    QWEN3_NEXT_80B,
)

MLX_4BIT = {"group_size": 64, "bits": 4}


def memory(config: dict[str, Any]) -> ModelMemory:
    m = model_memory(config)
    assert m is not None
    return m


def card(config: dict[str, Any], **fields: Any) -> ModelCard:
    """A card carrying the config's per-layer memory (the dimensions ModelCard needs are not read here)."""
    return ModelCard.model_validate({"model_id": "t/m", "family": "x", "n_layers": len(memory(config).layers),
                                     "hidden_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                                     "storage_size": {"inBytes": 1}, "memory": memory(config), **fields})


@pytest.mark.parametrize(("config", "published", "tolerance"), [
    (DEEPSEEK_V3, 671e9, 0.005), (KIMI_K2, 1.04e12, 0.02), (GLM_45, 355e9, 0.01),
    (GPT_OSS_120B, 116.83e9, 0.001), (QWEN3_235B, 235e9, 0.005), (QWEN3_NEXT_80B, 80e9, 0.01),
    (LLAMA4_SCOUT, 109e9, 0.02), (LLAMA4_MAVERICK, 400e9, 0.005), (GEMMA3_27B, 27e9, 0.01),
    (MINIMAX_M2, 230e9, 0.01), (MIXTRAL_8X7B, 46.7e9, 0.001), (NEMOTRON_H_8B, 8e9, 0.02),
], ids=["deepseek-v3", "kimi-k2", "glm-4.5", "gpt-oss-120b", "qwen3-235b", "qwen3-next-80b", "llama4-scout",
        "llama4-maverick", "gemma3-27b", "minimax-m2", "mixtral-8x7b", "nemotron-h-8b"])
def test_every_expert_resident_the_parameters_are_the_published_totals(
        config: dict[str, Any], published: float, tolerance: float) -> None:
    # In bfloat16 (gpt-oss without its MXFP4 layout) a model's loaded bytes are two per parameter. Kimi K2's "1T"
    # and Llama 4 Scout's 109B include what the text arithmetic leaves out (rounding; Scout's vision encoder).
    float_config = {k: v for k, v in config.items() if k != "quantization_config"}
    assert memory(float_config).loaded_bytes / 2 == pytest.approx(published, rel=tolerance)


def test_deepseek_v3_dense_first_then_moe_layers_and_its_unrun_mtp_layer() -> None:
    m = memory(DEEPSEEK_V3)
    # MLA attention: q_a 1536x7168 + q_a norm 1536 + q_b 128*192 x 1536 + kv_a (512+64) x 7168 + kv_a norm 512
    #   + kv_b 128*(128+128) x 512 + o 7168 x 128*128 = 187,107,328 parameters
    # dense MLP 3 x 7168 x 18432 = 396,361,728; two norms 14,336   -> 583,483,392 a dense layer (0..2)
    # MoE: 256 routed + 1 shared experts of 3 x 7168 x 2048 (11,318,329,344) + router 256 x 7168 and its bias 256
    #   -> 187,107,328 + 11,318,329,344 + 1,835,264 + 14,336 = 11,507,286,272 a MoE layer (3..60)
    assert [layer.weight_bytes // 2 for layer in m.layers[2:4]] == [583_483_392, 11_507_286_272]
    assert {layer.weight_bytes for layer in m.layers[3:]} == {2 * 11_507_286_272}
    # embedding and head 129280 x 7168 = 926,679,040 each (+ the final norm on the head)
    assert (m.embed_bytes, m.head_bytes) == (2 * 926_679_040, 2 * (926_679_040 + 7168))
    # the MTP layer (num_nextn_predict_layers 1): a MoE layer, eh_proj 7168 x 14336, three norms, and its own
    # embedding and head copies = 11,507,286,272 + 102,760,448 + 21,504 + 2 x 926,679,040 = 13,463,426,304:
    # in the files (685B = 671B + 14B), loaded by no rank
    assert m.unrun_bytes == 2 * 13_463_426_304
    assert m.loaded_bytes == 2 * 671_026_419_200


def test_qwen3_next_80b_counts_its_unrun_mtp_block() -> None:
    """Qwen3-Next-80B-A3B's files carry a multi-token-prediction block under mtp. (vLLM's qwen3_next_mtp.py reads
    it; mlx-lm and transformers drop it): one gated full-attention MoE layer, mtp.fc and three norms, sharing the
    model's embedding and head. Its published config names no count (no mtp_num_hidden_layers, no
    num_nextn_predict_layers): one layer. Qwen3.5's text_config says mtp_num_hidden_layers."""
    m = memory(QWEN3_NEXT_80B)
    # gated attention: q_proj 16 x 256 x 2 (the gate) x 2048 = 16,777,216 + k, v 2 x 512 x 2048 = 2,097,152
    #   + o 2048 x 4096 = 8,388,608 + q/k norms 2 x 256 = 27,263,488
    # MoE: 512 experts x 3 x 512 x 2048 = 1,610,612,736 + router 512 x 2048 = 1,048,576 + shared expert
    #   3 x 512 x 2048 = 3,145,728 + its gate 2048 = 1,614,809,088; two norms 4096 -> 1,642,076,672 a layer,
    #   what each of the decoder's full-attention layers (3, 7, ...) weighs too
    assert m.layers[3].weight_bytes == 2 * 1_642_076_672
    # + mtp.fc 2048 x 4096 = 8,388,608 + pre_fc_norm_embedding, pre_fc_norm_hidden, norm 3 x 2048 = 6,144
    assert m.unrun_bytes == 2 * 1_650_471_424
    assert memory({**QWEN3_NEXT_80B, "mtp_num_hidden_layers": 0}).unrun_bytes == 0
    assert memory({**QWEN3_NEXT_80B, "mtp_num_hidden_layers": 2}).unrun_bytes == 2 * (
        1_650_471_424 + 1_642_076_672)
    assert memory({**QWEN3_NEXT_80B, "mtp_num_hidden_layers": 0}).loaded_bytes == m.loaded_bytes
    # Qwen3.5 nests it in text_config; a dense model's MTP layer has the dense MLP:
    # 3 x 2048 x 5120 = 31,457,280 instead of the MoE's 1,614,809,088
    dense = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("num_experts", "model_type")}
    qwen3_5 = memory({"model_type": "qwen3_5", "text_config": {**dense, "model_type": "qwen3_5_text",
                                                               "mtp_num_hidden_layers": 1}})
    assert qwen3_5.unrun_bytes == 2 * (1_650_471_424 - 1_614_809_088 + 31_457_280)
    no_key = memory({"model_type": "qwen3_5", "text_config": {**dense, "model_type": "qwen3_5_text"}})
    assert no_key.unrun_bytes == 0


def test_qwen_mtp_tensors_count_as_unrun_not_as_the_first_ranks() -> None:
    """From the files' headers: mtp.layers.0.* is no decoder layer 0, mtp.fc and mtp.norm no embedding or final
    norm; all of it unrun."""
    config = {**QWEN3_NEXT_80B, "num_hidden_layers": 2}
    sizes = {"model.embed_tokens.weight": 100, "model.layers.0.self_attn.q_proj.weight": 10,
             "model.layers.1.self_attn.q_proj.weight": 11, "model.norm.weight": 1, "lm_head.weight": 90,
             "mtp.fc.weight": 7, "mtp.norm.weight": 2, "mtp.pre_fc_norm_hidden.weight": 2,
             "mtp.layers.0.self_attn.q_proj.weight": 5, "mtp.layers.0.mlp.experts.gate_up_proj": 20}
    m = memory_from_tensors(config, sizes)
    assert m is not None
    assert ([layer.weight_bytes for layer in m.layers], m.embed_bytes, m.head_bytes, m.unrun_bytes) == (
        [10, 11], 100, 91, 36)


@pytest.mark.parametrize(("config", "full", "local", "window"), [
    (DEEPSEEK_V3, 61 * (512 + 64) * 2, 0, 0),  # MLA: one latent of kv_lora_rank + rope per layer = 70,272
    (KIMI_K2, 61 * (512 + 64) * 2, 0, 0),  # the same latent whatever its 64 heads
    (GLM_45, 92 * 2 * 8 * 128 * 2, 0, 0),  # GQA: 376,832
    (GPT_OSS_120B, 18 * 2 * 8 * 64 * 2, 18 * 2 * 8 * 64 * 2, 128),  # alternate layers slide over 128 positions
    (QWEN3_235B, 94 * 2 * 4 * 128 * 2, 0, 0),  # 192,512
    (QWEN3_NEXT_80B, 12 * 2 * 2 * 256 * 2, 0, 0),  # one layer in four attends: 24,576; the rest keep a state
    (LLAMA4_SCOUT, 12 * 2 * 8 * 128 * 2, 36 * 2 * 8 * 128 * 2, 8192),  # NoPE layers whole, the rest chunked
    (GEMMA3_27B, 10 * 2 * 16 * 128 * 2, 52 * 2 * 16 * 128 * 2, 1024),  # 5 local : 1 global
    (MINIMAX_M2, 62 * 2 * 8 * 128 * 2, 0, 0),  # 253,952
    (MIXTRAL_8X7B, 32 * 2 * 8 * 128 * 2, 0, 0),  # 131,072
    (NEMOTRON_H_8B, 4 * 2 * 8 * 128 * 2, 0, 0),  # 4 attention blocks: 16,384
], ids=["deepseek-v3", "kimi-k2", "glm-4.5", "gpt-oss-120b", "qwen3-235b", "qwen3-next-80b", "llama4-scout",
        "gemma3-27b", "minimax-m2", "mixtral-8x7b", "nemotron-h-8b"])
def test_kv_bytes_a_position_by_layer_kind(config: dict[str, Any], full: int, local: int, window: int) -> None:
    c = card(config)
    assert group_bytes_per_token(c, 0, c.n_layers) == (full, local)
    assert local_window(c) == window


def test_mla_latent_is_whole_on_every_tensor_rank_and_heads_split() -> None:
    assert group_bytes_per_token(card(DEEPSEEK_V3), 0, 61, tensor_ways=4) == (70_272, 0)
    assert group_bytes_per_token(card(MIXTRAL_8X7B), 0, 32, tensor_ways=4) == (131_072 // 4, 0)
    # 8-bit KV: 576 elements + a 2-byte float16 scale a vector (kv_pools.kv_head_bytes), 61 layers
    assert group_bytes_per_token(card(DEEPSEEK_V3, kv_cache_bits=8), 0, 61) == (61 * (576 + 2), 0)


def test_linear_attention_and_ssm_keep_a_constant_state_per_stream() -> None:
    # Qwen3-Next's 36 gated DeltaNet layers: 32 value heads x 128 x 128 = 524,288 recurrent elements in float32
    # (as mlx-lm and transformers hold them, whatever the weights' dtype), and the convolution's last 3 inputs of
    # q, k, v = 3 x (2 x 16 x 128 + 32 x 128) = 24,576 in bf16 -> 36 x (2,097,152 + 49,152) = 36 x 2,146,304
    assert stream_state_bytes(card(QWEN3_NEXT_80B), 0, 48) == 77_266_944
    # Nemotron-H's 24 Mamba 2 blocks: 128 heads x 64 x 128 state = 1,048,576 in float32 (mamba_ssm_cache_dtype's
    # default), conv 3 x (8192 + 2 x 8 x 128) = 30,720 in bf16 -> 24 x (4,194,304 + 61,440) = 24 x 4,255,744
    assert stream_state_bytes(card(NEMOTRON_H_8B), 0, 52) == 102_137_856
    assert stream_state_bytes(card(NEMOTRON_H_8B | {"mamba_ssm_cache_dtype": "bfloat16"}), 0, 52) == (
        24 * (1_048_576 + 30_720) * 2)  # a config that asks for a bf16 SSM cache gets it
    assert stream_state_bytes(card(QWEN3_NEXT_80B), 0, 4) == 3 * 2_146_304  # layers 0-2 linear, 3 full


def test_the_torch_engine_holds_two_float32_slots_a_stream_in_each_delta_net_layer() -> None:
    """engines/torch/models/qwen3_next.StreamStates: a stream holds the state a step read and the one it wrote, the
    recurrent matrices in float32, the conv window in bf16: 36 x 2 x (524,288 x 4 + 24,576 x 2) = 36 x 4,292,608 =
    154,533,888 bytes a stream on Qwen3-Next-80B (MLX's figure, the card's state_bytes: one slot, 77,266,944). Mamba
    runs through transformers' fallback on torch: the layer's own figure. A placement counts MAX_STREAMS of them
    on each rank by its engine."""
    from skulk.master.shard_plan import MAX_STREAMS, plan_ring, pool_bytes
    from skulk.types.ids import NodeId
    from skulk.types.instances import Sharding

    nxt = card(QWEN3_NEXT_80B)
    assert stream_state_bytes(nxt, 0, 48, engine="torch") == 154_533_888
    assert stream_state_bytes(nxt, 0, 48, engine="mlx") == stream_state_bytes(nxt, 0, 48) == 77_266_944
    assert stream_state_bytes(nxt, 0, 48, tensor_ways=2, engine="torch") == 154_533_888 // 2
    assert stream_state_bytes(nxt, 0, 4, engine="torch") == 3 * 4_292_608
    nemotron = card(NEMOTRON_H_8B)
    assert stream_state_bytes(nemotron, 0, 52, engine="torch") == stream_state_bytes(nemotron, 0, 52) == 102_137_856
    more = MAX_STREAMS * (154_533_888 - 77_266_944)
    assert pool_bytes(nxt, 0, 48, 4096, streams=MAX_STREAMS, engine="torch") == (
        pool_bytes(nxt, 0, 48, 4096, streams=MAX_STREAMS, engine="mlx") + more)
    nxt = nxt.model_copy(update={"context_length": 4096})
    plans = {e: plan_ring(nxt, Sharding.Pipeline, [NodeId("a")], [1 << 40], engines=[e]) for e in ("torch", "mlx")}
    assert plans["torch"][0].kv_pool - plans["mlx"][0].kv_pool == more


def test_quantized_layouts_as_they_ship() -> None:
    # MLX affine 4-bit, groups of 64: 0.5 + 2 x 2 / 64 bytes a packed weight. DeepSeek's MoE layer packs all but
    # its norms (7168 x 2 + 1536 + 512) and its router (1,835,008 + 256, not a Linear in mlx-lm):
    # 11,505,434,624 x 0.5625 + 1,851,648 x 2 = 6,475,510,272
    ds4 = memory({**DEEPSEEK_V3, "quantization": MLX_4BIT})
    assert ds4.layers[3].weight_bytes == 6_475_510_272
    assert ds4.loaded_bytes == pytest.approx(377.6e9, rel=0.001)  # mlx-community's DeepSeek-V3 4-bit: ~378 GB
    # DeepSeek's own FP8 checkpoint: a byte a weight and a float32 scale per 128 x 128 block, ~688 GB with MTP
    fp8 = memory({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert fp8.loaded_bytes + fp8.unrun_bytes == pytest.approx(687.0e9, rel=0.001)
    # gpt-oss MXFP4 experts: 128 x 3 x 2880 x 2880 = 3,185,049,600 values at half a byte plus a scale byte per 32
    # = 1,692,057,600; the rest of the layer stays bf16 (28,030,592 x 2): 1,748,118,784; ~65 GB in all
    oss = memory(GPT_OSS_120B)
    assert oss.layers[0].weight_bytes == 1_692_057_600 + 2 * 28_030_592
    assert oss.loaded_bytes == pytest.approx(65.25e9, rel=0.001)
    # mixed precision: an 8-bit router on layer 0 (128 x 4096: 524,288 + 2 x 2 x 8192 bytes instead of
    # 524,288 x 0.5625) and an lm_head left in bf16 (151936 x 4096 x (2 - 0.5625))
    q4 = memory({**QWEN3_235B, "quantization": MLX_4BIT})
    mixed = memory({**QWEN3_235B, "quantization": {**MLX_4BIT, "model.layers.0.mlp.gate": {"bits": 8,
                                                                                         "group_size": 64},
                                                   "lm_head": False}})
    assert mixed.layers[0].weight_bytes - q4.layers[0].weight_bytes == 557_056 - 294_912
    assert mixed.head_bytes - q4.head_bytes == 151936 * 4096 * 2 - 151936 * 4096 * 9 // 16
    assert q4.loaded_bytes == pytest.approx(132.2e9, rel=0.001)  # mlx-community's Qwen3-235B-A22B-4bit


def test_per_layer_bytes_from_the_checkpoints_tensors() -> None:
    config = {**MIXTRAL_8X7B, "num_hidden_layers": 2}
    sizes = {"model.embed_tokens.weight": 100, "model.layers.0.self_attn.q_proj.weight": 10,
             "model.layers.0.mlp.experts.0.w1.weight": 30, "model.layers.1.self_attn.q_proj.weight": 11,
             "model.layers.2.eh_proj.weight": 7, "model.norm.weight": 1, "lm_head.weight": 90}
    m = memory_from_tensors(config, sizes)
    assert m is not None and m.source == "tensors"
    assert ([layer.weight_bytes for layer in m.layers], m.embed_bytes, m.head_bytes, m.unrun_bytes) == (
        [40, 11], 100, 91, 7)
    assert m.rank_weight_bytes(0, 1) == 140 and m.rank_weight_bytes(1, 2) == 102 and m.loaded_bytes == 242
    tied = memory_from_tensors(config, {k: v for k, v in sizes.items() if k != "lm_head.weight"})
    # no lm_head: tied; a last rank apart from the first loads the table again, one rank holding both once
    assert tied is not None and (tied.head_bytes, tied.tied_bytes) == (101, 100)
    assert (tied.rank_weight_bytes(1, 2), tied.loaded_bytes) == (11 + 101, 100 + 51 + 1)


def test_a_card_carries_the_arithmetic_only_when_it_accounts_for_the_files() -> None:
    files = memory(MIXTRAL_8X7B).loaded_bytes
    assert card_memory(MIXTRAL_8X7B, files) is not None
    assert card_memory(MIXTRAL_8X7B, files // 2) is None  # a layout the arithmetic does not know: the estimate
    llama = {**MIXTRAL_8X7B, "model_type": "llama", "num_local_experts": 0}
    built = card_from_config("t/llama", llama, memory(llama).loaded_bytes)
    assert built.memory is not None and built.memory.layers[0].kind == "full"


# ---------------------------------------------------------------------------------------------- previews

GB = 1024**3  # the machines say "128 GB" for 128 GiB


def deepseek_4bit_card() -> ModelCard:
    """mlx-community's DeepSeek-V3 4-bit as its card would be: its files hold no MTP layer (mlx-lm drops it)."""
    config = {**DEEPSEEK_V3, "quantization": MLX_4BIT}
    m = memory(config)
    return ModelCard.model_validate({
        "model_id": "mlx-community/DeepSeek-V3-4bit", "family": "deepseek_v3", "n_layers": 61, "hidden_size": 7168,
        "num_attention_heads": 128, "num_key_value_heads": 128, "storage_size": {"inBytes": m.loaded_bytes},
        "quantization": "4", "context_length": 163840, "vocab_size": 129280, "memory": m})


@pytest.mark.parametrize(("nodes", "node_gb"), [(2, 512), (4, 128), (8, 64)])
def test_deepseek_v3_4bit_previews_show_each_nodes_real_weights_and_kv(nodes: int, node_gb: int) -> None:
    from skulk.master.placement import preview_placements
    from skulk.types.instances import InstanceMeta, Sharding

    from .test_engine_choice import MAC
    from .test_placement import state

    c = deepseek_4bit_card()
    m = c.memory
    assert m is not None
    names = [chr(ord("a") + i) for i in range(nodes)]
    macs = state({n: node_gb * GB for n in names}).model_copy(update={"node_backends": dict.fromkeys(names, MAC)})
    previews = preview_placements(macs, c, Sharding.Pipeline, InstanceMeta.MlxRing)  # MLX ranks: the latent
    assert all(p.nodes[0].engine == "mlx" for p in previews if p.nodes)
    whole = [p for p in previews if len(p.node_ids) == nodes]
    assert whole and whole[0].error is None, whole[0].error if whole else "no ring of every node"
    ranks = whole[0].nodes
    assert [(r.start_layer, r.end_layer) for r in ranks][-1][1] == 61
    tokens = None
    for r in ranks:
        weights = m.rank_weight_bytes(r.start_layer, r.end_layer)  # its layers, embedding first, head last
        assert r.weights.in_bytes == pytest.approx(weights, rel=0.03)
        even = c.storage_size.in_bytes * (r.end_layer - r.start_layer) / 61  # the Llama-shaped estimate's share
        if r.start_layer > 0 and r.end_layer < 61:
            assert r.weights.in_bytes > 1.03 * even  # MoE layers only: heavier than the average (dense-first)
        per_token = (r.end_layer - r.start_layer) * 576 * 2  # MLA: one latent a layer a position
        tokens = tokens or r.kv_pool.in_bytes // per_token
        assert r.kv_pool.in_bytes == pytest.approx(tokens * per_token, rel=0.03)  # the same positions on every rank
        assert r.needed.in_bytes < r.free.in_bytes
    assert tokens is not None and tokens >= c.context_length  # at least one whole 163,840-token context
    assert sum(r.weights.in_bytes for r in ranks) == m.loaded_bytes


def test_deepseek_v3_costs_its_latent_on_torch_as_on_mlx() -> None:
    """The torch engine's native MLA caches the 576-wide latent (kv_lora_rank + qk_rope_head_dim, 1,152 bf16 bytes
    a layer and position, engines/torch/models/deepseek_v3.py) as MLX does, whole on every Tensor rank."""
    from skulk.master.shard_plan import group_bytes_per_token

    c = deepseek_4bit_card()
    assert c.memory is not None and c.memory.layers[0].torch_kv_heads == 0
    assert group_bytes_per_token(c, 0, 61, engine="torch") == group_bytes_per_token(c, 0, 61, 4, engine="torch")
    assert group_bytes_per_token(c, 0, 61, engine="mlx") == group_bytes_per_token(c, 0, 61, 4) == (61 * 576 * 2, 0)
    assert group_bytes_per_token(c, 0, 61, engine="torch") == (61 * 576 * 2, 0)


def test_an_explicit_deepseek_pool_is_checked_against_the_rings_engine() -> None:
    """20 GB holds a whole 163,840-token context of the latent (11.4 GB), which both engines cache: two Macs take
    it, and so do two Linux nodes (torch); 10 GB is refused on either, naming the bytes the latent needs."""
    from skulk.master.placement import preview_placements
    from skulk.types.instances import InstanceMeta, Sharding
    from skulk.types.placement import KvPoolTooSmall

    from .test_engine_choice import LINUX, MAC
    from .test_placement import state

    for tags, gb, fits in ((MAC, 20.0, True), (LINUX, 20.0, True), (LINUX, 10.0, False), (MAC, 10.0, False)):
        c = deepseek_4bit_card().model_copy(update={"kv_cache_gb": gb})
        nodes = state({"a": 512 * GB, "b": 512 * GB}).model_copy(update={"node_backends": dict.fromkeys("ab", tags)})
        whole = [p for p in preview_placements(nodes, c, Sharding.Pipeline, InstanceMeta.MlxRing)
                 if len(p.node_ids) == 2]
        assert whole, tags
        if fits:
            assert whole[0].error is None, whole[0].error
        else:
            error = whole[0].error
            assert isinstance(error, KvPoolTooSmall) and error.context_length == 163840, error
            assert error.least.in_bytes == 61 * 576 * 2 * 163840


def test_a_store_copy_is_carded_from_its_safetensors_headers(tmp_path: Any) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from skulk.models.memory_math import checkpoint_tensor_bytes

    config = {**MIXTRAL_8X7B, "model_type": "llama", "num_local_experts": 0, "num_hidden_layers": 2}
    save_file({"model.embed_tokens.weight": np.zeros((8, 4), np.float16),
               "model.layers.0.mlp.up_proj.weight": np.zeros((4, 4), np.float16),
               "model.layers.1.mlp.up_proj.weight": np.zeros((4, 8), np.float16),
               "model.norm.weight": np.zeros((4,), np.float16)}, str(tmp_path / "model.safetensors"))
    tensors = checkpoint_tensor_bytes(tmp_path)
    assert tensors["model.layers.1.mlp.up_proj.weight"] == 64
    built = card_from_config("t/tiny", config, 64 + 32 + 64 + 8, tensors)
    assert built.memory is not None and built.memory.source == "tensors"
    # tied (no lm_head): rank 0 embedding 64 + layer 32; the last rank its layer 64, the norm 8 and the table 64
    assert (built.memory.rank_weight_bytes(0, 1), built.memory.rank_weight_bytes(1, 2)) == (96, 136)
