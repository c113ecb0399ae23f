"""Mistral, Gemma 3 and Qwen3-MoE beyond float32 parity (test_model_families.py): half precision against
transformers, MLX-packed and quantized-at-load weights against the dequantized or float model, tensor-parallel
and pipeline splits against one rank, the sliding window over chunked prefill, the multimodal Gemma 3 layout,
and expert dispatch that runs only the experts the router picked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.config import text_config
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models import read_args_dir
from skulk.engines.torch.moe import SparseMoe
from skulk.engines.torch.quant import QuantizedLinear, affine_quantize, dequantize, fitting_group, pack_mlx
from skulk.master.shard_plan import kv_headroom_bytes
from skulk.models.catalog import card_from_config
from skulk.types.chat import SamplingParams
from tests.unit.test_model_families import REAL_CONFIGS, WINDOW, scaled_down, write_checkpoint
from tests.unit.test_quantized import logits, relative_error, write_mlx
from tests.unit.test_torch_engine import ThreadAllReduce

pytestmark = pytest.mark.timeout(120)

MISTRAL, MISTRAL_WINDOWED = "mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.1"
GEMMA, MOE = "google/gemma-3-1b-it", "Qwen/Qwen3-30B-A3B"
FAMILIES = (MISTRAL, GEMMA, MOE)
IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 3])  # 30 positions: past the window of 16

GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
"""google/gemma-3-4b-it's config.json: a multimodal checkpoint whose text_config leaves most numbers to
transformers' defaults (8 heads, 4 key/value heads, head_dim 256, ...)."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: with two busy cores (xdist runs two modules side by side), torch's second
    thread only adds barrier waits, measured at 10-30x the work itself under load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        model_id: write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), root / model_id.replace("/", "--"))
        for model_id in (*FAMILIES, MISTRAL_WINDOWED)
    }


@pytest.fixture(scope="module")
def gemma_4b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a gemma3_text checkpoint of gemma-3-4b's language model, scaled down; the same weights in the multimodal
    layout: config with text_config, tensors under language_model.model., a vision tower beside them)."""
    root = tmp_path_factory.mktemp("gemma4b")
    full = text_config(GEMMA3_4B)
    text = {**full, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 320,
            "intermediate_size": 1280, "num_hidden_layers": 6, "vocab_size": 512, "sliding_window": WINDOW,
            "torch_dtype": "float32"}
    text_dir = write_checkpoint(text, root / "text")
    weights = {f"language_model.{name}": t for name, t in load_file(str(text_dir / "model.safetensors")).items()}
    weights["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    multimodal = root / "multimodal"
    multimodal.mkdir()
    save_file(weights, str(multimodal / "model.safetensors"), metadata={"format": "pt"})
    shipped = {key: text[key] for key in (*GEMMA3_4B["text_config"], "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "vocab_size")}
    config = {**GEMMA3_4B, "torch_dtype": "float32", "text_config": shipped}
    (multimodal / "config.json").write_text(json.dumps(config))
    return text_dir, multimodal


def reference_logits(path: Path, dtype: torch.dtype, ids: torch.Tensor = IDS) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 0.03), (torch.float16, 0.01)])
@pytest.mark.parametrize("model_id", FAMILIES)
def test_half_precision_matches_transformers(
    model_id: str, dtype: torch.dtype, bound: float, checkpoints: dict[str, Path]
) -> None:
    """The same dtype on both sides; what differs is only rounding order (float32 parity is exact to 1e-4)."""
    model = load_model(checkpoints[model_id], dtype=dtype)
    assert next(model.parameters()).dtype == dtype
    assert relative_error(logits(model, IDS), reference_logits(checkpoints[model_id], dtype)) < bound


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("model_id", FAMILIES)
def test_mlx_checkpoint_matches_its_dequantized_weights(
    model_id: str, bits: int, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Every projection packed, experts and router included (and Gemma's tied embedding, which lm_head reads)."""
    write_mlx(checkpoints[model_id], bits, tmp_path / "mlx", tmp_path / "reference")
    model = load_model(tmp_path / "mlx")
    mlp = model.layers["0"].mlp
    projection = mlp.experts[3].down_proj if isinstance(mlp, SparseMoe) else mlp.down_proj  # type: ignore[index]
    assert isinstance(projection, QuantizedLinear) and isinstance(model.lm_head, QuantizedLinear)
    assert relative_error(logits(model, IDS), logits(load_model(tmp_path / "reference"), IDS)) < 0.03


@pytest.mark.parametrize(("kind", "bound"), [("int8", 0.05), ("int4", 0.03)])
@pytest.mark.parametrize("model_id", FAMILIES)
def test_float_checkpoint_quantized_at_load(
    model_id: str, kind: str, bound: float, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """int4 at load against the same affine groups dequantized (the router stays float on both sides, so the
    same experts run); int8, one scale per row, against the float model itself."""
    path = checkpoints[model_id]
    model = load_model(path, quantize=kind)
    if model_id == MOE:
        assert isinstance(model.layers["1"].mlp.experts[0].up_proj, QuantizedLinear)  # type: ignore[index]
        assert not isinstance(model.layers["1"].mlp.gate, QuantizedLinear)  # type: ignore[union-attr]  (router stays float)
    reference = load_model(path if kind == "int8" else _int4_reference(path, tmp_path), dtype=torch.float32)
    assert relative_error(logits(model, IDS), logits(reference, IDS)) < bound


def _int4_reference(path: Path, out: Path) -> Path:
    """path's weights with every projection and lm_head replaced by its int4 groups dequantized, each in the
    group the loader picks for its width; embedding and router as they are (a tied lm_head becomes its own)."""
    weights = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    for name, tensor in weights.items():
        if tensor.dim() == 2 and "embed_tokens" not in name and ".mlp.gate." not in name:
            group = fitting_group(tensor.shape[1], 64)
            assert group is not None
            weights[name] = dequantize(*affine_quantize(tensor, 4, group), group)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


def _split_logits(path: Path) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(one rank's logits, a two-stage pipeline's, each of two tensor-parallel ranks')."""
    whole = logits(load_model(path, dtype=torch.float32), IDS)
    first = load_model(path, end_layer=1, dtype=torch.float32)
    second = load_model(path, start_layer=1, dtype=torch.float32)
    with torch.inference_mode():
        batch = StepBatch.build(torch.arange(IDS.shape[1]).unsqueeze(0), 0)
        hidden = first(IDS, batch, first.make_cache(1, 64))
        piped = second(hidden, batch, second.make_cache(1, 64))
    reduce = ThreadAllReduce(2)
    shards = [load_model(path, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r), dtype=torch.float32)
              for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(lambda m: logits(m, IDS), shards))
    return whole, piped, ranks


def test_moe_splits_across_ranks_and_stages(checkpoints: dict[str, Path]) -> None:
    """Tensor parallel: each rank a slice of every expert, the router whole; pipeline: experts whole per stage."""
    shard = load_model(checkpoints[MOE], tp_rank=1, tp_size=2)
    moe = shard.layers["0"].mlp
    assert isinstance(moe, SparseMoe) and moe.gate.weight.shape == (16, 256)
    assert moe.experts[5].gate_proj.weight.shape == (64, 256)  # type: ignore[union-attr]
    assert moe.experts[5].down_proj.weight.shape == (256, 64)  # type: ignore[union-attr]
    whole, piped, ranks = _split_logits(checkpoints[MOE])
    torch.testing.assert_close(piped, whole, atol=1e-5, rtol=1e-5)
    for rank in ranks:
        torch.testing.assert_close(rank, whole, atol=1e-5, rtol=1e-5)


def test_gemma_multimodal_layout_runs_its_language_model(gemma_4b: tuple[Path, Path]) -> None:
    """The text part of a `gemma3` checkpoint: numbers from text_config and transformers' defaults, tensors
    under language_model.model., the vision tower left unread; split over ranks and stages like any model."""
    text_dir, multimodal = gemma_4b
    args = read_args_dir(multimodal)
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (4, 2, 64)
    assert args.layer_types.count("full_attention") == 1 and args.rope_scaling == {"factor": 8.0,
                                                                                     "rope_type": "linear"}
    whole, piped, ranks = _split_logits(multimodal)
    torch.testing.assert_close(whole, reference_logits(text_dir, torch.float32), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(piped, whole, atol=1e-5, rtol=1e-5)
    for rank in ranks:
        torch.testing.assert_close(rank, whole, atol=1e-5, rtol=1e-5)
    card = card_from_config("google/gemma-3-4b-it", GEMMA3_4B, 8_600_000_000)
    assert (card.family, card.n_layers, card.hidden_size) == ("gemma3", 34, 2560)
    assert (card.num_attention_heads, card.num_key_value_heads, card.vocab_size) == (8, 4, 262208)


def _chunked(model: ModelSlice, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits of ids fed `chunk` tokens at a time into one cache, positions continuing where the last ended."""
    cache, parts = model.make_cache(1, 64), []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            positions = torch.arange(start, start + piece.shape[1]).unsqueeze(0)
            parts.append(model(piece, StepBatch.build(positions, 0), cache))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("model_id", [MISTRAL_WINDOWED, GEMMA])
def test_sliding_window_over_chunks_and_decode(model_id: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A 30-token prompt through a window of 16: one pass, chunks of 7 and token-by-token decode agree with
    transformers; the window matters (the same weights without it differ past position 16, not before)."""
    path = checkpoints[model_id]
    model = load_model(path, dtype=torch.float32)
    expected = reference_logits(path, torch.float32)
    for chunk in (IDS.shape[1], 7, 1):
        torch.testing.assert_close(_chunked(model, IDS, chunk), expected, atol=1e-4, rtol=1e-4)
    unwindowed = tmp_path / "unwindowed"
    unwindowed.mkdir()
    (unwindowed / "model.safetensors").symlink_to(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    everything = logits(load_model(unwindowed, dtype=torch.float32), IDS)
    torch.testing.assert_close(everything[:, :WINDOW], expected[:, :WINDOW], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(everything[:, WINDOW:], expected[:, WINDOW:], atol=1e-3)


def test_moe_decode_runs_only_the_picked_experts(checkpoints: dict[str, Path]) -> None:
    """One decode token runs exactly k = 8 of the 16 experts per sparse layer, each once; a prefill runs each
    picked expert once over all of its rows. Counted on moe.py's torch dispatch, whose expert modules hooks see
    (cpu_moe.c dispatches the same way in one call: tests/unit/test_cpu_moe.py holds the two equal)."""
    model = load_model(checkpoints[MOE], dtype=torch.float32)
    calls: list[int] = []
    for layer in model.layers.values():
        layer._native, layer.mlp._kernel = False, False  # type: ignore[union-attr]
        for expert in layer.mlp.experts:  # type: ignore[union-attr]
            expert.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    cache = model.make_cache(1, 64)
    with torch.inference_mode():
        model(IDS, StepBatch.build(torch.arange(30).unsqueeze(0), 0), cache)
        assert len(calls) <= 2 * 16 and sum(calls) == 2 * 30 * 8
        calls.clear()
        model(IDS[:, :1], StepBatch.build(torch.tensor([[30]]), 0), cache)
    assert calls == [1] * (2 * 8)


def _write_mlx_moe(float_dir: Path, mlx_dir: Path, reference_dir: Path, group: int = 32) -> None:
    """float_dir's Qwen3-MoE as mlx-lm saves it: each layer's experts stacked per projection into
    mlp.switch_mlp.{gate,up,down}_proj [experts, out, in] and packed at 4 bits, the router packed at 8 bits
    under its own entry in the quantization section; reference_dir holds the same weights dequantized."""
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    stacks: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    quantization: dict[str, Any] = {"group_size": group, "bits": 4}
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        if tensor.dim() != 2:
            packed[name] = dequantized[name] = tensor
            continue
        base = name.removesuffix(".weight")
        bits = 8 if base.endswith(".mlp.gate") else 4
        if bits == 8:
            quantization[base] = {"group_size": group, "bits": 8}
        q, scales, biases = affine_quantize(tensor, bits, group)
        scales, biases = scales.to(torch.bfloat16), biases.to(torch.bfloat16)
        dequantized[name] = dequantize(q, scales, biases, group)
        parts = {"weight": pack_mlx(q, bits), "scales": scales, "biases": biases}
        if ".mlp.experts." in base:
            start, rest = base.split(".mlp.experts.")
            expert, projection = rest.split(".")
            stacks.setdefault(f"{start}.mlp.switch_mlp.{projection}", []).append((int(expert), parts))
        else:
            packed |= {f"{base}.{part}": value for part, value in parts.items()}
    for base, experts in stacks.items():
        experts.sort(key=lambda item: item[0])
        for part in ("weight", "scales", "biases"):
            packed[f"{base}.{part}"] = torch.stack([parts[part] for _, parts in experts])
    config = json.loads((float_dir / "config.json").read_text())
    for folder, tensors, extra in ((mlx_dir, packed, {"quantization": quantization}),
                                   (reference_dir, dequantized, {"torch_dtype": "float32"})):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))


def test_mlx_moe_layout_with_stacked_experts(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """mlx-community's Qwen3-MoE layout loads (stacked experts, an 8-bit router beside 4-bit experts), matches
    its dequantized weights, and gives one rank's greedy tokens split over two tensor-parallel ranks or two
    pipeline stages."""
    _write_mlx_moe(checkpoints[MOE], tmp_path / "mlx", tmp_path / "reference")
    model = load_model(tmp_path / "mlx")
    moe = model.layers["1"].mlp
    assert isinstance(moe, SparseMoe) and isinstance(moe.gate, QuantizedLinear) and moe.gate.bits == 8
    assert isinstance(moe.experts[15].down_proj, QuantizedLinear) and moe.experts[15].down_proj.bits == 4
    assert relative_error(logits(model, IDS), logits(load_model(tmp_path / "reference"), IDS)) < 0.03
    reduce = ThreadAllReduce(2)
    shards = [load_model(tmp_path / "mlx", tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(_greedy, shards))
    assert ranks[0] == ranks[1] == _greedy(model)
    assert _greedy([load_model(tmp_path / "mlx", end_layer=1), load_model(tmp_path / "mlx", start_layer=1)]) == ranks[0]


def _greedy(model: ModelSlice | list[ModelSlice], steps: int = 4, prompt: torch.Tensor = IDS[:, :8]) -> list[int]:
    """Greedy tokens after prompt (one pass), then one token per step; through a chain of pipeline stages when
    given a list."""
    return greedy_stages(model if isinstance(model, list) else [model], steps, prompt)


def greedy_stages(stages: list[ModelSlice], steps: int, prompt: torch.Tensor) -> list[int]:
    """Greedy tokens after prompt ([1, n] ids, one pass) through a chain of pipeline stages, one token per step."""
    ids, pos, out = prompt, torch.arange(prompt.shape[1]).unsqueeze(0), []
    caches = [stage.make_cache(1, prompt.shape[1] + steps) for stage in stages]
    with torch.inference_mode():
        for _ in range(steps):
            x = ids
            for stage, cache in zip(stages, caches, strict=True):
                x = stage(x, StepBatch.build(pos, 0), cache)
            ids = x[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
            pos = pos[:, -1:] + 1
    return out


def test_quantized_gemma_splits_give_one_ranks_tokens(gemma_4b: tuple[Path, Path], tmp_path: Path) -> None:
    """The multimodal Gemma 3 layout packed at 4 bits: two pipeline stages and two tensor-parallel ranks give
    one rank's greedy tokens."""
    write_mlx(gemma_4b[1], 4, tmp_path / "mlx", tmp_path / "reference")
    path = tmp_path / "mlx"
    expected = _greedy(load_model(path))
    assert _greedy([load_model(path, end_layer=3), load_model(path, start_layer=3)]) == expected
    reduce = ThreadAllReduce(2)
    shards = [load_model(path, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(_greedy, shards)) == [expected, expected]


@pytest.mark.parametrize("model_id", [GEMMA, MOE])
def test_engine_chunked_prefill_and_prefix_reuse(model_id: str, checkpoints: dict[str, Path]) -> None:
    """Through the engine: a 30-token prompt prefilled 7 tokens at a time past the window, then the next turn
    (prompt, reply, more) starting from the first turn's KV, each giving the one-pass greedy tokens."""
    path = checkpoints[model_id]
    engine = TorchEngine(path, max_batch=2, max_seq=64, prefill_chunk=7, dtype=torch.float32)
    model = load_model(path, dtype=torch.float32)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    prompt = IDS[0].tolist()
    for turn in ("first", "second"):
        engine.add_request(turn, prompt, greedy)
        tokens: list[int] = []
        while engine.has_work():
            tokens += [t.token_id for t in engine.step()]
        assert tokens == _greedy(model, 5, torch.tensor([prompt]))
        prompt = prompt + tokens + [5, 9, 33]


def test_kv_headroom_uses_the_configs_head_dim() -> None:
    """Qwen3-MoE's heads are 128 wide though hidden / heads is 64: placement sizes the KV cache by 128."""
    card = card_from_config(MOE, REAL_CONFIGS[MOE], 61_000_000_000)
    assert (card.family, card.head_dim, card.n_layers) == ("qwen3_moe", 128, 48)
    assert kv_headroom_bytes(card, 48) == 2 * 48 * 4 * 128 * 40960 * 2
    assert card_from_config(GEMMA, REAL_CONFIGS[GEMMA], 2_000_000_000).head_dim == 256


@pytest.mark.parametrize("model_id", [GEMMA, MOE])
def test_a_transformers_5_config_reads_the_same(model_id: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """config.json as transformers 5 rewrites it (rope_parameters per layer type, layer_types spelled out,
    num_local_experts) describes the same model as the hub's."""
    path = checkpoints[model_id]
    AutoConfig.from_pretrained(str(path)).save_pretrained(tmp_path)
    rewritten = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in rewritten and "rope_theta" not in rewritten
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    hub = read_args_dir(path)
    assert read_args_dir(tmp_path) == hub


def test_gemma_softcapping_matches_transformers(tmp_path: Path) -> None:
    """Gemma 3 ships softcapping off; a config that sets it (Gemma 2's 50 on attention scores, 30 on logits)
    is honoured as transformers' eager attention does."""
    config = {**scaled_down(GEMMA, REAL_CONFIGS[GEMMA]), "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0}
    path = write_checkpoint(config, tmp_path / "softcapped")
    reference = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="eager")
    with torch.no_grad():
        expected = reference(IDS).logits
    got = logits(load_model(path, dtype=torch.float32), IDS)
    torch.testing.assert_close(got, expected, atol=5e-4, rtol=1e-4)  # eager attention's rounding: up to 2e-4
    assert not torch.allclose(got, logits(load_model(_without_softcaps(path, tmp_path), dtype=torch.float32), IDS))


def _without_softcaps(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "uncapped"
    out.mkdir()
    (out / "model.safetensors").symlink_to(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": None,
                                                 "final_logit_softcapping": None}))
    return out
