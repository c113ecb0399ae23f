"""The sparse MoE block on the C kernels (engines/torch/cpu_moe.c through cpu_kernels.MoeKernel) against moe.py's torch
dispatch: the picked experts in one call computing what the per-expert loop computes, bit for bit (the same matmul
kernels, sort and roundings); the router's softmax top-k in C choosing what torch's does; and a Qwen3-MoE's decode
step through the one-call layer stack (attention and MoE of every layer in skulk_decode_layers) giving the per-step
path's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.moe import GroupedMoe, SparseMoe
from tests.unit.family_checkpoints import tokenizer_donor
from tests.unit.test_cpu_kernels import _batched_logits, _mixed_logits, relative
from tests.unit.test_glm4_moe import _write_grouped
from tests.unit.test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not cpu_kernels.available(), reason="needs an AVX2/FMA/F16C CPU and a C compiler"),
]
MODEL_ID = "Qwen/Qwen3-30B-A3B"
OPTIONS: list[dict[str, Any]] = [{"dtype": "float32"}, {"dtype": "bfloat16"},
                                 {"quantize": "int4"}, {"quantize": "int8"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = scaled_down(MODEL_ID, REAL_CONFIGS[MODEL_ID])
    return write_checkpoint(config, tmp_path_factory.mktemp("moe") / "qwen3_moe")


def _blocks(model: torch.nn.Module) -> list[SparseMoe]:
    return [m for m in model.modules() if isinstance(m, SparseMoe)]


def _torch_path(block: SparseMoe) -> None:
    block._kernel = False  # the per-expert Python loop from here on


@pytest.mark.parametrize("options", OPTIONS)
def test_the_experts_in_one_call_are_the_per_expert_loop(checkpoint: Path, options: dict[str, Any]) -> None:
    """mix through cpu_moe.c: every row count from one (the single-token path) to more rows than experts, the same
    routing given to both, identical outputs."""
    model = load_model(checkpoint, **options)
    block = _blocks(model)[0]
    kernel = block.kernel()
    assert kernel is not None and block.layer_kernel() is kernel
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 2, 5, 8, 23):
        x = torch.randn(rows, model.args.hidden_size, generator=generator).to(model.args.dtype)
        with torch.inference_mode():
            weights, chosen = block.route(x)
            ours = kernel.mix(x, weights, chosen)
            block._kernel = False
            theirs = block.mix(x, weights, chosen)
            block._kernel = kernel
        assert torch.equal(ours, theirs), rows
    many = torch.zeros(40, model.args.hidden_size, dtype=model.args.dtype)  # a prefill's rows
    assert (block.kernel_for(many) is kernel) == ("quantize" in options or model.args.dtype == torch.float32)


@pytest.mark.parametrize("options", OPTIONS[1:3])
def test_grouped_experts_run_in_one_call_routed_in_torch(tmp_path: Path, options: dict[str, Any]) -> None:
    """GLM-4 MoE's block (DeepSeek V3's kind): its sigmoid grouped routing stays torch's, its float32 weights and
    routed experts go to the one call, which gives the per-expert loop's output."""
    demo = tokenizer_donor(tmp_path)
    model = load_model(_write_grouped(tmp_path, demo), **options)
    block = next(m for m in model.modules() if isinstance(m, GroupedMoe))
    kernel = block.kernel()
    assert kernel is not None and not kernel.routes and block.layer_kernel() is None
    x = torch.randn(6, model.args.hidden_size, generator=torch.Generator().manual_seed(2)).to(model.args.dtype)
    with torch.inference_mode():
        weights, chosen = block.route(x)
        assert weights.dtype == torch.float32
        ours = kernel.mix(x, weights, chosen)
        _torch_path(block)
        theirs = block.mix(x, weights, chosen)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("options", OPTIONS[1:3])
def test_the_router_in_c_picks_what_torch_picks(checkpoint: Path, options: dict[str, Any], normalize: bool) -> None:
    """The whole block in C (its softmax top-k routing too, the top k renormalised or not: norm_topk_prob) against
    route + mix in torch: the same experts, so the outputs agree within the weights' rounding (the softmax's exp
    differs from torch's in the last bits); another pick would be a whole expert's output off."""
    model = load_model(checkpoint, **options)
    block = _blocks(model)[0]
    block.normalize = normalize
    kernel = block.kernel()
    assert kernel is not None and kernel.desc.normalize == normalize
    x = torch.randn(16, model.args.hidden_size, generator=torch.Generator().manual_seed(1)).to(model.args.dtype)
    with torch.inference_mode():
        ours = kernel(x)
        _torch_path(block)
        theirs = block(x)
    assert relative(ours, theirs) < 1e-2


@pytest.mark.parametrize("options", OPTIONS)
def test_a_moe_decode_step_runs_through_the_one_call_layer_stack(tmp_path: Path, checkpoint: Path,
                                                                 options: dict[str, Any]) -> None:
    """Every Qwen3-MoE layer (attention, norms and the MoE block) in skulk_decode_layers, rows at different
    positions: the per-step torch path's logits and greedy tokens (its routing's softmax is torch's)."""
    model = load_model(checkpoint, **options)
    native = _batched_logits(model)
    assert model._stack is not None and model._stack[2] is not None  # the one-call stack ran
    for layer in model.layers.values():
        layer._native = False  # type: ignore[union-attr]
    for block in _blocks(model):
        _torch_path(block)
    per_step = _batched_logits(model)
    assert model._stack is not None and model._stack[2] is None
    for got, expected in zip(native, per_step, strict=True):
        assert relative(got, expected) < 1e-3
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("options", OPTIONS[2:3])
def test_a_short_mixed_step_of_a_moe_runs_through_the_layer_stack(checkpoint: Path, options: dict[str, Any]) -> None:
    """Decode rows and a small prefill chunk in one stack call (model._mixed_stack), the MoE routing each row on its
    own: the per-layer path's logits within rounding (its chunk attention is torch's) and its greedy tokens."""
    model = load_model(checkpoint, **options)
    native = _mixed_logits(model, 4)
    assert model._stack is not None and model._stack[2] is not None
    for layer in model.layers.values():
        layer._native = False  # type: ignore[union-attr]
    per_layer = _mixed_logits(model, 4)
    for got, expected in zip(native, per_layer, strict=True):  # the chunk's bf16 SDPA drift, through 8 experts
        assert relative(got, expected) < 2e-2
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_experts_in_one_call_are_the_same_on_any_thread_count(checkpoint: Path, threads: int) -> None:
    """cpu_moe.c runs a step's picked experts each on one thread (skulk_quant_rows, no parallel region per matrix),
    spread over the threads, and sums them afterwards in expert order: on one thread or two, the per-expert loop's
    output bit for bit (quantized experts, where that path runs; float ones too)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for options in (OPTIONS[2], OPTIONS[1]):
            model = load_model(checkpoint, **options)
            block = _blocks(model)[0]
            kernel = block.kernel()
            assert kernel is not None
            x = torch.randn(8, model.args.hidden_size, generator=torch.Generator().manual_seed(3)).to(model.args.dtype)
            with torch.inference_mode():
                weights, chosen = block.route(x)
                ours = kernel.mix(x, weights, chosen)
                _torch_path(block)
                theirs = block.mix(x, weights, chosen)
            assert len(chosen.unique()) > 1 and torch.equal(ours, theirs), options
    finally:
        torch.set_num_threads(before)
