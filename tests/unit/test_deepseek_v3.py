"""DeepSeek V3 on the torch engine's own layers (engines/torch/models/deepseek_v3.py: multi-head latent
attention, GLM-4 MoE's grouped experts), against transformers' modeling.

Two seeded random checkpoints in transformers 5's layout: family_checkpoints' (the one the MLX tests share:
q through its low-rank pair, interleaved rope, a dense first layer then experts with a shared one, two expert
groups of which one is eligible), and a variant that turns on what that one leaves off (one q_proj, the
half-split rope layout, YaRN with an mscale_all_dim folded into the softmax scale, values wider than keys,
q/kv biases drawn, unnormalised weights). Each one's 16 greedy tokens for two prompts are transformers' (its
forward over the whole sequence each step): on one rank through the engine (both prompts batched), and through
a two-stage pipeline; two tensor-parallel ranks give one rank's logits; bfloat16 stays near transformers'
bfloat16. Decode attends with kv_b_proj absorbed over a cache of one latent a position (its bytes what the card
says), a prefill expanding the latents, the two forms agreeing. A kimi_k2-typed config runs as this family, and an
FP8 block-scaled copy is held at 8 bits, group by group what its dequantized weights quantize to, at about the
file's bytes and what its card says (an explicit int4 at load winning). The catalog then cards the family as
native, with the cache the torch engine really keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch import fp8
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.layers import DecoderLayer
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models import deepseek_v3
from skulk.engines.torch.models.deepseek_v3 import MlaAttention
from skulk.engines.torch.moe import GroupedMoe
from skulk.engines.torch.pace import module_bytes
from skulk.engines.torch.quant import QuantizedLinear
from skulk.master.shard_plan import group_bytes_per_token
from skulk.models.catalog import card_from_config
from skulk.models.memory_math import checkpoint_tensor_bytes, model_memory, torch_dequantized_growth
from tests.unit.family_checkpoints import (
    PROMPTS,
    TOKENS,
    disagreement,
    reference,
    tokenizer_donor,
    with_tokenizer,
    write,
    write_model,
)
from tests.unit.test_glm4_moe import (
    _engine_tokens,
    assert_bf16_near_transformers,
    assert_mixed_step_tokens,
    assert_tensor_ranks_match,
    assert_transformers_tokens,
    held_bytes,
    one_thread,  # noqa: F401 - the module's autouse fixture: one torch thread for tiny models
)
from tests.unit.test_quantized import logits
from tests.unit.test_torch_engine import ThreadAllReduce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real model compute: `make test`, not `make test-fast`

VARIANT: dict[str, Any] = {
    "q_lora_rank": None, "rope_interleave": False, "v_head_dim": 32, "attention_bias": True,
    "norm_topk_prob": False, "n_shared_experts": 2, "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 0.7, "original_max_position_embeddings": 512},
}
"""What the shared checkpoint leaves off (its config is transformers' defaults there)."""
IDS = torch.tensor([PROMPTS[0]])


def _write_variant(root: Path, demo: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The variant, its attention biases drawn (transformers starts them at zero, which would test nothing)."""
    from transformers import AutoModelForCausalLM

    base = write_model("deepseek_v3", root / f"variant_{str(dtype).removeprefix('torch.')}", **VARIANT)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("proj.bias") or name.endswith("proj_with_mqa.bias"):
                tensor.normal_(0, 0.1)
    (model.bfloat16() if dtype == torch.bfloat16 else model).save_pretrained(base)
    return with_tokenizer(base, demo)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek-v3")
    demo = tokenizer_donor(root)
    shared = write("deepseek_v3", root, demo)
    fp8_path, dequantized = _as_fp8(with_tokenizer(write_model("deepseek_v3", root / "fp8_source", kv_lora_rank=32),
                                                   demo), root)
    return {"shared": shared, "variant": _write_variant(root, demo),
            "variant_bf16": _write_variant(root, demo, torch.bfloat16), "kimi_k2": _as_kimi_k2(shared, root),
            "fp8": fp8_path, "fp8_dequantized": dequantized}


def _as_kimi_k2(path: Path, root: Path) -> Path:
    """The shared checkpoint as Kimi K2 publishes its config: DeepSeek V3's architecture (architectures
    DeepseekV3ForCausalLM) under its own model_type, kimi_k2, which transformers does not know."""
    import json
    import shutil

    kimi = shutil.copytree(path, root / "kimi_k2")
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    return kimi


@pytest.mark.parametrize("name", ["shared", "variant"])
def test_greedy_tokens_are_transformers_on_one_rank_and_a_pipeline(name: str, checkpoints: dict[str, Path]) -> None:
    assert_transformers_tokens(checkpoints[name])


FP8_BLOCK = (32, 32)
"""The test's FP8 blocks: DeepSeek publishes 128 x 128, which would make every matrix of the tiny model one block;
32 x 32 gives most several, kv_a_proj_with_mqa's 40 rows a partial one, and the engine groups of 32 (footprint.
fp8_group: the widest that divides the block, as 128 does DeepSeek's), which a tensor rank's half of o_proj's 64
columns splits into whole. The FP8 checkpoint's kv_lora_rank is 32, so kv_b_proj too could take groups: it stays
float by rule (footprint.FP8_FLOAT_KEPT), not for want of one."""


def _as_fp8(path: Path, root: Path) -> tuple[Path, Path]:
    """A float checkpoint as DeepSeek publishes its weights: every decoder projection (not the router, the
    embedding or the head) float8_e4m3fn with a `weight_scale_inv` per block, and quantization_config saying so;
    beside it the float32 checkpoint of exactly those weights dequantized by hand (the reference). The FP8 one
    names no end-of-sequence token, so every request runs its 16 tokens."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    packed, plain = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale = fp8.quantize(weight, FP8_BLOCK)
            packed[name], packed[f"{name}_scale_inv"] = q, scale
            per_row = scale.repeat_interleave(FP8_BLOCK[0], 0)[: weight.shape[0]]
            plain[name] = q.float() * per_row.repeat_interleave(FP8_BLOCK[1], 1)[:, : weight.shape[1]]
    out = {}
    for kind, weights in (("fp8", packed), ("fp8_dequantized", plain)):
        out[kind] = shutil.copytree(path, root / kind)
        save_file(weights, out[kind] / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (out["fp8"] / "generation_config.json").unlink()  # no end token: the weights moved, and may now pick it
    (out["fp8"] / "config.json").write_text(json.dumps({**config, "eos_token_id": None, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}}))
    return out["fp8"], out["fp8_dequantized"]


def test_fp8_blocks_dequantize_to_their_scaled_values() -> None:
    """DeepSeek's 128 x 128 blocks over a matrix that ends in partial ones: each value is its block's multiplier
    times the float8 value, in float32, and within e4m3's rounding (3 mantissa bits: 1/16 of the value, or a
    subnormal step of the block's scale) of the matrix quantized."""
    torch.manual_seed(0)
    weight = torch.randn(300, 200)
    q, scale = fp8.quantize(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    got = fp8.dequantize(q, scale, (128, 128))
    assert torch.equal(got[130:140, 150:160], q[130:140, 150:160].float() * scale[1, 1])
    assert torch.equal(got[299, :128], q[299, :128].float() * scale[2, 0])
    per_row = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert bool(((got - weight).abs() <= weight.abs() / 16 + per_row * 2**-9).all())
    into = torch.empty(300, 200, dtype=torch.bfloat16)
    assert fp8.dequantize(q, scale, (128, 128), into) is into and torch.equal(into, got.bfloat16())
    with pytest.raises(ValueError, match="needs scales"):
        fp8.dequantize(q, scale[:2], (128, 128))


def _fp8_weights(path: Path) -> list[str]:
    """The module paths (in the slice) of the weights the FP8 checkpoint stores as FP8."""
    names = checkpoint_tensor_bytes(path)
    return [n.removeprefix("model.").removesuffix(".weight") for n in names if f"{n}{fp8.SCALE_SUFFIX}" in names]


def _weight(model: ModelSlice, name: str) -> torch.Tensor:
    weight = model.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor), name
    return weight


def _assert_held_as_quantized(model: ModelSlice, floats: ModelSlice, paths: list[str], bits: int) -> None:
    """Each module at paths holds exactly what quantizing floats' weight at load would (same
    group, same layout): the FP8 blocks dequantized and quantized a band at a time lose nothing more."""
    for path in paths:
        held, weight = model.get_submodule(path), _weight(floats, path)
        assert isinstance(held, QuantizedLinear) and held.bits == bits, path
        if bits == 8:
            expected = QuantizedLinear.int8_from_float(weight, held.group)
        else:
            from skulk.engines.torch.quant import affine_quantize

            expected = QuantizedLinear.from_affine(*affine_quantize(weight, 4, held.group), 4, held.group)
        assert torch.equal(held.weight, expected.weight) and torch.equal(held.params, expected.params), path


def test_an_fp8_checkpoint_is_held_at_8_bits_and_decodes_near_its_float_weights(
        checkpoints: dict[str, Path]) -> None:
    """With no quantize-at-load asked, every weight the file stores as FP8 is held at 8 bits in groups of 32 (the
    block's width here), exactly what quantizing its dequantized float weight would give, but kv_b_proj, which
    stays float for the absorbed decode (footprint.FP8_FLOAT_KEPT); what the file stores in float (embedding,
    norms, router, head) stays float32, the config's dtype. The logits stay near the float checkpoint's: the 8-bit
    kernels' rounding (weights, and activations per group) is ~1% a projection, compounded over this tiny model's
    peaked three layers to 1-8% of the largest logit a position (the engine's int8 at load of the same float
    weights measured the same); a position may also route to other experts on it. Each of two tensor ranks holds
    what quantizing its rows or columns of the float weights would."""
    path, plain = checkpoints["fp8"], checkpoints["fp8_dequantized"]
    model, floats = load_model(path), load_model(plain)
    assert model.args.dtype == torch.float32
    stored = _fp8_weights(path)
    kept = [p for p in stored if p.endswith("kv_b_proj")]
    assert kept and len(stored) > 3 * len(kept)
    _assert_held_as_quantized(model, floats, [p for p in stored if p not in kept], bits=8)
    for name in (*kept, "lm_head", "embed_tokens", "layers.1.mlp.gate"):
        module = model.get_submodule(name)
        assert not isinstance(module, QuantizedLinear), name
        assert torch.equal(_weight(model, name), _weight(floats, name)), name
    got, expected = logits(model, IDS)[0], logits(floats, IDS)[0]
    errors = (got - expected).abs().amax(-1) / expected.abs().amax(-1)
    assert int((errors >= 0.1).sum()) <= 1 and float(errors.median()) < 0.08, errors
    tokens, expected_tokens = _engine_tokens(path), reference(plain)  # batched prefill, absorbed decode
    assert {rid: (len(t), t[0]) for rid, t in tokens.items()} == {
        rid: (TOKENS, t[0]) for rid, (t, _) in expected_tokens.items()}  # later tokens part after a few: above
    _assert_ranks_hold_their_blocks(path, floats)


def _assert_ranks_hold_their_blocks(path: Path, floats: ModelSlice) -> None:
    """Each of two tensor ranks holds, of every FP8 weight, exactly what quantizing its rows or columns of the
    float weight would (an expert's down_proj, 16 columns a rank, takes no group and stays float, as its block)."""
    from skulk.engines.torch.model import tp_split_dim

    reduce = ThreadAllReduce(2)
    for rank in range(2):
        model = load_model(path, tp_rank=rank, tp_size=2, all_reduce=reduce.for_rank(rank))
        for name in _fp8_weights(path):
            weight, dim = _weight(floats, name), tp_split_dim(f"{name}.weight")
            if dim is not None:
                weight = weight.narrow(dim, rank * weight.shape[dim] // 2, weight.shape[dim] // 2).contiguous()
            held = model.get_submodule(name)
            if isinstance(held, QuantizedLinear):
                expected = QuantizedLinear.int8_from_float(weight, held.group)
                assert torch.equal(held.weight, expected.weight) and torch.equal(held.params, expected.params), name
            else:
                assert torch.equal(_weight(model, name), weight), name


def test_an_fp8_checkpoint_holds_about_its_file_bytes_as_its_card_says(checkpoints: dict[str, Path]) -> None:
    """The runner holds each 8-bit weight at about its FP8 bytes (a byte a value, and an f16 scale and bias per group
    of 32 here, 12.5%, where DeepSeek's 128 make it 3%: test_a_published_fp8_checkpoint_is_held_near_its_file_bytes_
    on_torch), under half of what dequantizing to the config's float32 held; and the card's torch figure (the
    files plus torch_dequantized_growth) is what the whole slice holds within 3%."""
    import json

    path = checkpoints["fp8"]
    tensors = checkpoint_tensor_bytes(path)
    files = sum(tensors.values())
    model, dequantized = load_model(path), load_model(checkpoints["fp8_dequantized"])
    eight_bit = [name for name in _fp8_weights(path) if not name.endswith("kv_b_proj")]
    held = module_bytes(torch.nn.ModuleList(model.get_submodule(name) for name in eight_bit))  # fused: once
    stored = sum(tensors[f"model.{name}.weight"] + tensors[f"model.{name}.weight{fp8.SCALE_SUFFIX}"]
                 for name in eight_bit)
    assert stored < held <= 1.13 * stored, (held, stored)
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("deepseek-ai/deepseek-tiny-fp8", config, files)
    assert card.torch_runtime == "native" and card.compatible_backends is None
    assert card.torch_storage_size is not None
    carded, whole = card.torch_storage_size.in_bytes, module_bytes(model)
    assert abs(whole - carded) <= 0.03 * carded, (whole, carded)
    assert files < whole < module_bytes(dequantized) / 2, (files, whole)


def test_an_explicit_quantize_at_load_wins_over_fp8s_8_bits(checkpoints: dict[str, Path]) -> None:
    """quantize="int4" on an FP8 checkpoint: every FP8 weight held at 4 bits, what int4 at load of its dequantized
    float weight holds, kv_b_proj too (as int4 at load of a float checkpoint does: decode then expands the latents
    through it), and the head, computing in bfloat16; fewer bytes than the default 8 bits."""
    path = checkpoints["fp8"]
    model = load_model(path, quantize="int4")
    floats = load_model(checkpoints["fp8_dequantized"])
    assert model.args.dtype == torch.bfloat16
    _assert_held_as_quantized(model, floats, _fp8_weights(path), bits=4)
    assert isinstance(model.get_submodule("lm_head"), QuantizedLinear)
    assert module_bytes(model) < module_bytes(load_model(path))


@pytest.mark.parametrize("name", ["DEEPSEEK_V3", "KIMI_K2"])
def test_a_published_fp8_checkpoint_is_held_near_its_file_bytes_on_torch(name: str) -> None:
    """What the torch engine holds of DeepSeek V3's (Kimi K2's) FP8 files: each FP8 weight at a byte a value and
    4 bytes of scale and bias per 128 (its 128 x 128 blocks' width) instead of a float32 scale per 16384 values,
    and kv_b_proj in bfloat16: about 3% over the files, where dequantizing held the bfloat16 model, twice."""
    from tests.unit import flagship_configs

    config = getattr(flagship_configs, name)
    quantized = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    bf16, packed = model_memory(config), model_memory(quantized)
    assert bf16 is not None and packed is not None
    c = config.get("text_config", config)
    kv_b = int(c["num_hidden_layers"]) * int(c["num_attention_heads"]) * int(c["kv_lora_rank"]) * (
        int(c["qk_nope_head_dim"]) + int(c["v_head_dim"]))
    fp8_values = bf16.loaded_bytes - packed.loaded_bytes  # a byte a value less, less 4 bytes a block of 16384
    growth = torch_dequantized_growth(quantized)
    assert growth == pytest.approx((fp8_values - kv_b) * 4 / 128 + kv_b - fp8_values * 4 / 128**2, rel=1e-3)
    assert 0.025 * packed.loaded_bytes < growth < 0.04 * packed.loaded_bytes


def test_kimi_k2_runs_natively_as_deepseek_v3(checkpoints: dict[str, Path]) -> None:
    """A kimi_k2-typed config loads through this family: its greedy tokens are transformers' DeepseekV3 ones for
    the same weights, and the catalog cards it native on torch, caching what the engine caches."""
    import json

    path = checkpoints["kimi_k2"]
    assert load_model(path).args.model_type == "kimi_k2"
    assert (why := disagreement(_engine_tokens(path), reference(checkpoints["shared"]))) is None, why
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("moonshotai/kimi-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "kimi_k2"
    memory = model_memory(config)
    assert memory is not None
    layered = card.model_copy(update={"memory": memory})
    assert group_bytes_per_token(layered, 0, 3, engine="torch") == (load_model(path).kv_bytes_per_token(), 0)


def test_the_layers_are_the_configs(checkpoints: dict[str, Path]) -> None:
    """The variant: one q_proj, YaRN (its cos/sin scaled, the softmax scale with mscale_all_dim's factor squared),
    one cache head as wide as the latent and its rope key (16 + 8); layer 0 dense, the rest grouped MoE with two
    shared experts."""
    model = load_model(checkpoints["variant"])
    args = model.args
    assert args.mla is not None and args.mla.q_lora_rank is None and not args.mla.interleaved
    assert args.head_dim == 24 and args.num_key_value_heads == 1 and args.rotary_dim == 8
    assert model.rope.attention_factor != 1.0 and args.mla.scale != pytest.approx(24**-0.5)
    dense, sparse = model.layers["0"], model.layers["1"]
    assert isinstance(dense, DecoderLayer) and isinstance(dense.self_attn, MlaAttention)
    assert not isinstance(dense.mlp, GroupedMoe)
    assert isinstance(sparse, DecoderLayer) and isinstance(sparse.mlp, GroupedMoe)
    assert sparse.mlp.shared_experts is not None and sparse.mlp.shared_experts.down_proj.weight.shape == (64, 64)
    assert hasattr(dense.self_attn, "q_proj") and not hasattr(dense.self_attn, "q_a_proj")


def test_tensor_parallel_ranks_give_one_ranks_logits(checkpoints: dict[str, Path]) -> None:
    """q_b_proj and kv_b_proj split by heads, o_proj by columns, the low-rank projections whole."""
    assert_tensor_ranks_match(checkpoints["shared"])


def test_bfloat16_stays_near_transformers(checkpoints: dict[str, Path]) -> None:
    """A bfloat16 checkpoint in bfloat16 on both sides: only rounding order differs (float32 matches above), each
    position's logits within 3% of transformers'; one position per prompt may have taken the other expert group
    on a near tie (test_glm4_moe's reasoning)."""
    assert_bf16_near_transformers(checkpoints["variant_bf16"])


def test_the_catalog_cards_deepseek_v3_as_native(checkpoints: dict[str, Path]) -> None:
    """Native now: its card says so, the per-layer weight arithmetic (models/memory_math.model_memory) is the
    bytes the engine holds, layer for layer, and placement's torch figure for a position's cache is the engine's
    own: the latent, as MLX keeps it."""
    import json

    path = checkpoints["shared"]
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("deepseek-ai/deepseek-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "deepseek_v3"
    memory = model_memory(config)
    assert memory is not None
    model = load_model(path)
    held = [held_bytes(layer) for layer in model.layers.values()]
    assert [layer.weight_bytes for layer in memory.layers] == held
    layered = card.model_copy(update={"memory": memory})  # a tiny file's headers are too much of it to card
    assert group_bytes_per_token(layered, 0, 3, engine="torch") == (model.kv_bytes_per_token(), 0)
    assert group_bytes_per_token(layered, 0, 3, engine="mlx") == (3 * (16 + 8) * 4, 0)  # the latent, float32
    assert model.kv_bytes_per_token() == 3 * (16 + 8) * 4


def test_the_cache_holds_one_latent_and_rope_key_a_position(checkpoints: dict[str, Path]) -> None:
    """Per layer and position the cache holds kv_lora_rank + qk_rope_head_dim elements (16 + 8, float32: 96
    bytes), once: a single key head whose first kv_lora_rank columns are also the values (so the value pool is
    empty, not a copy). That is what the engine allocates and what it advertises, in float and at 8 bits (the
    elements and one float16 scale); a tensor rank holds the whole latent, as the card says."""
    model = load_model(checkpoints["shared"])
    cache = model.make_cache(4, 32)
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (4, 1, 32, 16 + 8) and layer.values.numel() == 0
    assert cache.nbytes == 4 * 32 * model.kv_bytes_per_token() == 4 * 32 * 3 * (16 + 8) * 4
    assert model.make_cache(4, 32, bits=8).nbytes == 4 * 32 * model.kv_bytes_per_token(bits=8) == 4 * 32 * 3 * 26
    rank = load_model(checkpoints["shared"], tp_rank=1, tp_size=2, all_reduce=ThreadAllReduce(2).for_rank(1))
    assert rank.kv_bytes_per_token() == model.kv_bytes_per_token()


def _greedy(model: ModelSlice, steps: int = 8, bits: int = 16, fed: list[int] | None = None
            ) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after PROMPTS[0] (one prefill pass, then one token a step) and each step's last logits; fed:
    the tokens to feed back instead of the greedy ones."""
    ids, pos = IDS, torch.arange(IDS.shape[1]).unsqueeze(0)
    cache, tokens, rows = model.make_cache(1, IDS.shape[1] + steps, bits=bits), [], []
    with torch.inference_mode():
        for _ in range(steps):
            rows.append(model(ids, StepBatch.build(pos, 0), cache)[0, -1])
            tokens.append(int(rows[-1].argmax()) if fed is None else fed[len(tokens)])
            ids = torch.tensor([[tokens[-1]]])
            pos = pos[:, -1:] + 1
    return tokens, torch.stack(rows)


def test_decode_attends_in_latent_space_and_agrees_with_the_expanded_form(
        checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step attends with kv_b_proj absorbed (queries in latent space over the one cached latent head);
    the prompt's pass expands the cached latents per head. Either form over every step gives the same logits,
    and so does an 8-bit cache of the latent, within its rounding (fed the same tokens)."""
    model = load_model(checkpoints["shared"])
    seen: list[tuple[int, int]] = []
    attend = deepseek_v3._attention

    def spying(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        seen.append((q.shape[2], k.shape[1]))
        return attend(q, k, v, mask, scale)

    monkeypatch.setattr(deepseek_v3, "_attention", spying)
    tokens, mixed = _greedy(model)
    assert {heads for rows, heads in seen if rows == 1} == {1} and {h for r, h in seen if r > 1} == {4}
    for rows in (0, 1 << 20):  # every step expanded, every step absorbed
        monkeypatch.setattr(MlaAttention, "ABSORB_ROWS", rows)
        same, got = _greedy(model)
        assert same == tokens
        torch.testing.assert_close(got, mixed, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(MlaAttention, "ABSORB_ROWS", 1)
    _, eight = _greedy(model, bits=8, fed=tokens)
    errors = (eight - mixed).abs().amax(-1) / mixed.abs().amax(-1)
    assert int((errors >= 0.05).sum()) <= 1, errors  # about 1%; one step may route to other experts on the noise


def test_a_prompt_joining_running_decodes_rides_a_mixed_step(checkpoints: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A second request arriving while the first decodes: its prefill shares steps with the decode row (a
    MixedBatch, each part attended on its own rows), and both still give transformers' tokens."""
    assert_mixed_step_tokens(checkpoints["shared"], MlaAttention, monkeypatch)
