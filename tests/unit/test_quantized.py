"""Quantized weights: MLX-community 4/8-bit checkpoints in their own layout, and float checkpoints quantized
at load, each against the float model of the same (dequantized) weights; split over pipeline and tensor ranks.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    affine_quantize,
    dequantize,
    pack_mlx,
    quant_spec,
    unpack_mlx,
)
from skulk.models.cards import with_quantization
from skulk.types.ids import ModelId
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from tests.unit.test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint
from tests.unit.test_torch_engine import ThreadAllReduce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # runs real model compute: `make test`, not `make test-fast`

GROUP = 32
IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 3])


def write_mlx(float_dir: Path, bits: int, mlx_dir: Path, reference_dir: Path, group: int = GROUP,
              embeddings: bool = True) -> None:
    """float_dir's checkpoint as MLX packs it (every projection, an untied lm_head and, unless told otherwise,
    the embedding: packed uint32 weight with bf16 scales and biases), and reference_dir with the same weights
    dequantized."""
    weights = load_file(str(float_dir / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(".weight") and tensor.dim() == 2 and (embeddings or "embed_tokens" not in name):
            q, scales, biases = affine_quantize(tensor, bits, group)
            scales, biases = scales.to(torch.bfloat16), biases.to(torch.bfloat16)
            base = name.removesuffix(".weight")
            packed |= {name: pack_mlx(q, bits), f"{base}.scales": scales, f"{base}.biases": biases}
            dequantized[name] = dequantize(q, scales, biases, group)
        else:
            packed[name] = dequantized[name] = tensor
    config = json.loads((float_dir / "config.json").read_text())
    for folder, tensors, extra in ((mlx_dir, packed, {"quantization": {"group_size": group, "bits": bits}}),
                                   (reference_dir, dequantized, {"torch_dtype": "float32"})):
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))


def logits(model: ModelSlice, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, StepBatch.build(torch.arange(ids.shape[1]).unsqueeze(0), 0), model.make_cache(1, 64))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def float_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("float")
    return {
        model_id: write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), root / model_id.replace("/", "--"))
        for model_id in ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                         "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B")
    }


def test_mlx_packing_round_trips() -> None:
    for bits in (4, 8):
        q = torch.randint(0, 2**bits, (16, 64), dtype=torch.uint8)
        words = pack_mlx(q, bits)
        assert words.dtype == torch.uint32 and words.shape == (16, 64 * bits // 32)
        assert torch.equal(unpack_mlx(words, bits), q)


def test_quant_spec_reads_mlx_and_refuses_what_it_cannot_run() -> None:
    assert quant_spec({"quantization": {"group_size": 64, "bits": 4}}, None).prequantized  # type: ignore[union-attr]
    assert quant_spec({}, "int8").bits == 8  # type: ignore[union-attr]
    assert quant_spec({}, None) is None
    with pytest.raises(ValueError, match="3-bit"):
        quant_spec({"quantization": {"group_size": 64, "bits": 3}}, None)
    with pytest.raises(ValueError, match="MLX affine"):
        quant_spec({"quantization_config": {"quant_method": "gptq"}}, None)
    with pytest.raises(ValueError, match="int4 or int8"):
        quant_spec({}, "fp8")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("model_id", ["meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                                      "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B"])
def test_mlx_checkpoint_matches_its_dequantized_weights(
    model_id: str, bits: int, float_models: dict[str, Path], tmp_path: Path
) -> None:
    write_mlx(float_models[model_id], bits, tmp_path / "mlx", tmp_path / "reference")
    model = load_model(tmp_path / "mlx")
    layer = model.layers["0"]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear)  # type: ignore[union-attr]
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    packed_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    float_bytes = sum(p.numel() * 4 for p in load_model(tmp_path / "reference").parameters())
    assert packed_bytes < float_bytes * (0.25 if bits == 4 else 0.4)
    # bf16 activations against float32 ones: the error the kernels add on top of the quantization itself
    assert relative_error(logits(model), logits(load_model(tmp_path / "reference"))) < 0.03


def test_float_checkpoint_quantized_at_load(float_models: dict[str, Path], tmp_path: Path) -> None:
    """int4 at load is MLX's affine quantization (the group that fits: 224 columns take 32), so it matches the
    same weights dequantized; int8, one scale per row, stays close to the float model itself."""
    path = float_models["Qwen/Qwen2.5-7B-Instruct"]
    int4 = load_model(path, quantize="int4")
    assert isinstance(int4.layers["0"].mlp.down_proj, QuantizedLinear)  # type: ignore[union-attr]
    assert isinstance(int4.embed_tokens, torch.nn.Embedding)  # a lookup: it stays float
    write_mlx(path, 4, tmp_path / "mlx", tmp_path / "reference", group=32, embeddings=False)
    assert relative_error(logits(int4), logits(load_model(tmp_path / "reference"))) < 0.03
    int8 = load_model(path, quantize="int8")
    assert relative_error(logits(int8), logits(load_model(path, dtype=torch.float32))) < 0.05


def _greedy(models: list[ModelSlice], steps: int = 5) -> list[int]:
    """Greedy tokens through a chain of pipeline slices (one model = the whole)."""
    caches = [m.make_cache(1, 64) for m in models]
    ids, pos, out = IDS[:, :8], torch.arange(8).unsqueeze(0), []
    with torch.inference_mode():
        for _ in range(steps):
            x = ids
            for model, cache in zip(models, caches, strict=True):
                x = model(x, StepBatch.build(pos, 0), cache)
            ids = x[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
            pos = pos[:, -1:] + 1
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pipeline_and_tensor_splits_equal_one_rank(
    bits: int, float_models: dict[str, Path], tmp_path: Path
) -> None:
    write_mlx(float_models["meta-llama/Llama-3.1-8B-Instruct"], bits, tmp_path / "mlx", tmp_path / "reference")
    path = tmp_path / "mlx"
    whole = load_model(path)
    expected = _greedy([whole])
    assert _greedy([load_model(path, end_layer=1), load_model(path, start_layer=1)]) == expected

    reduce = ThreadAllReduce(2)
    shards = [load_model(path, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(lambda m: _greedy([m]), shards)
    assert rank0 == rank1 == expected
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(logits, shards))
    assert relative_error(parts[0], logits(whole)) < 0.02


def test_quantized_card_memory_never_runs_short() -> None:
    """Placement fits the quantized estimate: about 1/3.5 (int4) or 1/2 (int8) of a bf16 model, the float
    embedding and a quantized copy for a tied lm_head included."""
    card = ModelCard(model_id=ModelId("x/llama-70b"), family="llama", n_layers=80, hidden_size=8192,
                     num_attention_heads=64, num_key_value_heads=8, storage_size=Memory.from_bytes(141_000_000_000),
                     dtype="bfloat16", vocab_size=128256)
    int4, int8 = with_quantization(card, "int4"), with_quantization(card, "int8")
    assert int4.quantize_at_load == "int4" and int8.quantize_at_load == "int8"
    params = 141e9 / 2
    embed = 128256 * 8192
    assert (params - embed) * 0.5 + embed * 2 < int4.storage_size.in_bytes < 141e9 / 3.2
    assert (params - embed) * 1.0 + embed * 2 < int8.storage_size.in_bytes < 141e9 / 1.8
    assert with_quantization(card, None) is card
    unknown = with_quantization(card.model_copy(update={"vocab_size": None}), "int4")
    assert unknown.storage_size.in_bytes > int4.storage_size.in_bytes
    with pytest.raises(ValueError, match="already quantized"):
        with_quantization(card.model_copy(update={"quantization": "4"}), "int8")
