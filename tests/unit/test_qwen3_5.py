"""Qwen3.5 on the torch engine's own layers (engines/torch/models/qwen3_5.py), against transformers' modeling.

Seeded random checkpoints in the published layout, saved by transformers' Qwen3_5MoeForConditionalGeneration (and
the dense Qwen3_5ForConditionalGeneration): config.text_config beside a vision_config, the decoder's tensors under
model.language_model., a tiny vision tower under model.visual. that the engine does not load. Layers linear, full,
linear, full; every MLP of the MoE a MoE with a gated shared expert; norms, decays and conv kernels drawn (transformers
starts the norms at zero and dt_bias at one). Their 16 greedy tokens for two prompts of different lengths, decoded
together, are transformers' (its forward over the whole sequence each step) on one rank, through a two-stage
pipeline (in-process stages [0, 2) and [2, 4)) and through two tensor-parallel rank processes (each holding half of
every layer's heads, its key heads' rows of each of in_proj_qkv's q, k and v parts); two in-process tensor ranks
give one rank's logits. A prompt longer than the delta rule's chunk, prefilled in two engine chunks, ends on
transformers' logits. The catalog cards qwen3_5_moe as native, and the memory arithmetic counts its decoder's
bytes and its torch streams' states from the nested text_config."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch.loader import load_model
from skulk.engines.torch.models.qwen3_5 import Qwen3_5Layer, SplitDeltaNet
from skulk.formats.checkpoint import safetensors_header
from skulk.models.catalog import card_from_config
from skulk.models.memory_math import TORCH_STATE_SLOTS, model_memory
from tests.unit.family_checkpoints import COMMON, PROMPTS, save_drawn, tokenizer_donor
from tests.unit.test_glm4_moe import (
    assert_tensor_ranks_match,
    assert_transformers_tokens,
    one_thread,  # noqa: F401 - the module's autouse fixture: one torch thread for tiny models
)
from tests.unit.test_quantized import logits
from tests.unit.test_qwen3_next import (
    assert_chunked_prefill_is_transformers,
    assert_mtp_block_neither_loaded_nor_staged,
    assert_tensor_rank_processes_give_transformers_tokens,
)
from tests.unit.test_torch_engine import ThreadAllReduce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

TEXT: dict[str, Any] = {**{k: v for k, v in COMMON.items() if k != "tie_word_embeddings"},
                        "num_hidden_layers": 4, "head_dim": 16, "linear_num_value_heads": 4,
                        "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                        "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"] * 2}
MOE = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
          "num_position_embeddings": 16, "patch_size": 2}
"""A vision tower as small as transformers builds one: only there so the checkpoint is the published layout."""


def draw(model: Any) -> Any:
    """The language model's norms, dt biases and decays drawn away from transformers' initial values (ones,
    zeros), so a swapped or dropped one changes the tokens (test_gguf_moe's Qwen3.5 files draw the same)."""
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")) and ".visual." not in name:
                tensor.normal_(0.5, 0.3)
            elif name.endswith("A_log"):
                tensor.uniform_(-1, 1)
    return model


def _write(root: Path, demo: Path, moe: bool) -> Path:
    import transformers

    torch.manual_seed(1)
    if moe:
        config: Any = transformers.Qwen3_5MoeConfig(text_config=TEXT | MOE, vision_config=VISION,
                                                   tie_word_embeddings=False)
        model: Any = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5Config(text_config=TEXT | {"intermediate_size": 96}, vision_config=VISION,
                                            tie_word_embeddings=False)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    model = draw(model.float().eval())
    return save_drawn(model, root, "qwen3_5_moe" if moe else "qwen3_5", torch.float32, demo)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-5")
    demo = tokenizer_donor(root)
    return {"moe": _write(root, demo, moe=True), "dense": _write(root, demo, moe=False)}


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_greedy_tokens_are_transformers_on_one_rank_and_a_pipeline(name: str, checkpoints: dict[str, Path]) -> None:
    """Both prompts decoded together on one rank (their states side by side in each linear layer's pool), and
    through stages [0, 2) and [2, 4) (each building only its layers, from model.language_model.)."""
    config = json.loads((checkpoints[name] / "config.json").read_text())
    assert "text_config" in config and "vision_config" in config  # the published, multimodal layout
    model = load_model(checkpoints[name])
    assert all(isinstance(layer, Qwen3_5Layer) for layer in model.layers.values())
    assert model.args.image_token_id is None  # no tower runs: text only
    assert_transformers_tokens(checkpoints[name])


def test_two_tensor_parallel_ranks_give_one_ranks_logits(checkpoints: dict[str, Path]) -> None:
    """Each rank holds its key heads' rows of each of in_proj_qkv's three parts and of the conv, its value heads'
    rows of in_proj_z, in_proj_b, in_proj_a and their decays, half of every expert and of the shared expert."""
    model = load_model(checkpoints["moe"], tp_rank=1, tp_size=2)
    linear = model.layers["0"].linear_attn
    assert isinstance(linear, SplitDeltaNet)
    assert linear.in_proj_qkv.weight.shape == (64, 64) and linear.in_proj_z.weight.shape == (32, 64)
    assert_tensor_ranks_match(checkpoints["moe"])


def test_two_tensor_rank_processes_give_transformers_tokens(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    assert_tensor_rank_processes_give_transformers_tokens(checkpoints["moe"], tmp_path)


def test_a_long_prompt_in_two_chunks_ends_on_transformers_logits(checkpoints: dict[str, Path]) -> None:
    assert_chunked_prefill_is_transformers(checkpoints["moe"])


def test_the_catalog_cards_qwen3_5_moe_as_native(checkpoints: dict[str, Path]) -> None:
    """Native for the torch engine, from the wrapper's model_type; its per-layer arithmetic from the nested
    text_config is the checkpoint's decoder bytes, layer for layer (the gate on q_proj, q/k norms and the shared
    expert's gate counted), and a torch stream's states two float32 slots per linear layer."""
    path = checkpoints["moe"]
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("Qwen/qwen3.5-moe-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "qwen3_5_moe" and card.n_layers == 4
    memory = model_memory(config)
    assert memory is not None and [layer.kind for layer in memory.layers] == ["linear", "full"] * 2
    header = safetensors_header(path / "model.safetensors")
    for i, layer in enumerate(memory.layers):
        prefix = f"model.language_model.layers.{i}."
        real = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k.startswith(prefix))
        assert layer.weight_bytes == real, i
    # per linear layer: 4 value heads x 16 x 16 float32, the conv's last 3 inputs of q, k, v (32 + 32 + 64) float32
    assert [layer.torch_state_bytes for layer in memory.layers] == [TORCH_STATE_SLOTS * (1024 * 4 + 384 * 4), 0] * 2
    model = load_model(path)
    assert model.state_bytes_per_stream() == sum(layer.torch_state_bytes for layer in memory.layers)


def _fused(path: Path, into: Path) -> Path:
    """The checkpoint with each layer's experts fused as Qwen3.5's published files keep them (transformers 5's
    in-memory layout): mlp.experts.gate_up_proj [experts, 2 x width, hidden], gate rows then up rows, and
    mlp.experts.down_proj [experts, hidden, width]."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, into)
    tensors = load_file(str(path / "model.safetensors"))
    experts = MOE["num_experts"]
    for layer in range(TEXT["num_hidden_layers"]):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        pop = {name: [tensors.pop(f"{p}{e}.{name}.weight") for e in range(experts)]
               for name in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{p}gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(pop["gate_proj"], pop["up_proj"],
                                                                                    strict=True)])
        tensors[f"{p}down_proj"] = torch.stack(pop["down_proj"])
    save_file(tensors, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


def test_fused_experts_load_as_the_per_expert_ones(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The published layout's fused experts give the per-expert checkpoint's logits, on one rank and on each of
    two tensor ranks (each reading its block of the gate half and of the up half)."""
    fused = _fused(checkpoints["moe"], tmp_path / "fused")
    ids = torch.tensor([PROMPTS[0]])
    expected = logits(load_model(checkpoints["moe"]), ids)
    torch.testing.assert_close(logits(load_model(fused), ids), expected, atol=1e-5, rtol=1e-5)
    reduce = ThreadAllReduce(2)
    shards = [load_model(fused, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        for rank in pool.map(lambda m: logits(m, ids), shards):
            torch.testing.assert_close(rank, expected, atol=1e-4, rtol=1e-4)



@pytest.mark.parametrize("name", ["moe", "dense"])
def test_an_mtp_block_in_the_files_is_neither_loaded_nor_staged(name: str, checkpoints: dict[str, Path],
                                                                tmp_path: Path) -> None:
    """Qwen3.5's MTP block (mtp_num_hidden_layers in text_config): the MoE's in the published layout, its experts
    and the decoder's fused (_fused), which a pipeline stage staged without the MTP file loads without reading."""
    path = _fused(checkpoints["moe"], tmp_path / "fused") if name == "moe" else checkpoints["dense"]
    mtp = tmp_path / "mtp"
    assert_mtp_block_neither_loaded_nor_staged(path, mtp)
    weight_map = json.loads((mtp / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("mtp.layers.0.mlp.experts.gate_up_proj" in weight_map) == (name == "moe")


def test_int8_at_load_splits_in_proj_qkv_part_by_part(checkpoints: dict[str, Path]) -> None:
    """Quantized while loading, each of two tensor ranks quantizes its own rows of each of in_proj_qkv's q, k and
    v parts (int8 rows are quantized one by one, so a rank's rows are the whole model's rows): its outputs are
    exactly the one-rank projection's at those rows. (Whole-model logits are no check here: on these tiny random
    delta-rule models bfloat16 alone moves them by 40%.)"""
    path = checkpoints["moe"]
    x = torch.randn(1, 3, TEXT["hidden_size"], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))

    def qkv(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            return model.layers["0"].linear_attn.in_proj_qkv(x)

    keys = TEXT["linear_num_key_heads"] * TEXT["linear_key_head_dim"]
    values = TEXT["linear_num_value_heads"] * TEXT["linear_value_head_dim"]
    parts = qkv(load_model(path, quantize="int8")).split([keys, keys, values], dim=-1)
    for rank in range(2):
        got = qkv(load_model(path, tp_rank=rank, tp_size=2, quantize="int8"))
        assert torch.equal(got, torch.cat([part.chunk(2, dim=-1)[rank] for part in parts], dim=-1)), rank


def test_the_engine_shares_no_prefix_and_speculates_none(checkpoints: dict[str, Path]) -> None:
    """Qwen3.5 keeps per-stream DeltaNet states as Qwen3-Next does: its family is `stateful`, so the engine turns
    prefix sharing and speculation off (a shared block carries no state; a rejected draft would leave it ahead)."""
    from skulk.engines.torch.engine import TorchEngine

    engine = TorchEngine(checkpoints["moe"], max_batch=2, max_seq=64, block_size=4)
    try:
        assert engine.model.family.stateful and not engine.share_prefixes and not engine.speculate
    finally:
        engine.close()
