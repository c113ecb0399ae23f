"""Logits and greedy picks that survive a split (issue 41): the head's logits reach the sampler as its float32
accumulator, so two candidates closer than bf16's step at their magnitude (0.125 near 20) stay apart; an exact tie
goes to the lowest token id on every path; a Tensor split's all-reduce adds float32 copies of its parts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.layers import Rope
from skulk.engines.torch.model import ModelSlice, _rounded
from skulk.engines.torch.models import read_args
from skulk.engines.torch.sampling import RowSampling, greedy, sample

pytestmark = pytest.mark.timeout(60)

HIDDEN, VOCAB = 64, 16
LOW, HIGH = 3, 11
"""Two candidates: HIGH's logit is 20.03125, LOW's 20.0; bf16 rounds both to 20.0 (its step there is 0.125)."""


def _tiny(dtype: torch.dtype) -> ModelSlice:
    """One layer that adds nothing (o_proj and down_proj are zero), token 0 embedded as ones, so the normed
    hidden state is all ones and each logit is its lm_head row's sum: 20.0 for LOW, 20.03125 for HIGH."""
    config = {"model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 64, "torch_dtype": str(dtype).removeprefix("torch.")}
    args = read_args(config)
    model = ModelSlice(args)
    model.to_empty(device="cpu")
    model.rope = Rope(args, "cpu")  # to_empty left its frequencies uninitialised
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.embed_tokens.weight[0] = 1.0  # type: ignore[union-attr]
        model.norm.weight.fill_(1.0)  # type: ignore[union-attr]
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
        head = model.lm_head.weight  # type: ignore[union-attr]
        head[LOW] = 20.0 / HIDDEN  # 0.3125: exact in bf16 and f16
        head[HIGH] = 20.0 / HIDDEN
        head[HIGH, 0] += 0.03125  # 0.34375: exact too
    return model.to(dtype)


@pytest.fixture(params=["kernels", "torch"])
def paths(request: pytest.FixtureRequest) -> Iterator[str]:
    """Our CPU kernels (where they build) and torch's own ops: both must hand the sampler f32 logits."""
    if request.param == "kernels" and not cpu_kernels.available():
        pytest.skip("the CPU kernels do not run here")
    cpu_kernels.set_enabled(request.param == "kernels")
    try:
        yield request.param
    finally:
        cpu_kernels.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 20], ids=["decode", "prefill"])
def test_a_bf16_tie_is_resolved_by_the_f32_logits(paths: str, dtype: torch.dtype, rows: int) -> None:
    model = _tiny(dtype)
    cache = model.make_cache(1, 32)
    ids = torch.zeros(1, rows, dtype=torch.long)
    with torch.inference_mode():
        logits = model(ids, StepBatch.build(torch.arange(rows).unsqueeze(0), 0), cache)
    assert logits.dtype == torch.float32
    last = logits[0, -1]
    assert float(last[HIGH] - last[LOW]) == pytest.approx(0.03125, abs=1e-4)
    assert last.to(torch.bfloat16)[HIGH] == last.to(torch.bfloat16)[LOW], "the two must tie once rounded to bf16"
    assert greedy(last).item() == HIGH
    greedy_row = RowSampling(temperature=0.0, top_k=0, top_p=1.0, generator=torch.Generator())
    assert sample(logits[:, -1], [greedy_row]) == [HIGH]


def test_an_exact_tie_goes_to_the_lowest_token_id() -> None:
    logits = torch.full((3, 49152), -5.0)
    logits[0, [40000, 123, 49151]] = 7.5
    logits[1, [9, 8]] = 1.0
    logits[2, :] = 0.0  # every token ties
    assert greedy(logits).tolist() == [123, 8, 0]
    assert greedy(logits.to(torch.bfloat16)).tolist() == [123, 8, 0]
    seeded = torch.Generator().manual_seed(0)
    rows = [RowSampling(temperature=0.0, top_k=0, top_p=1.0, generator=seeded),
            RowSampling(temperature=0.7, top_k=1, top_p=1.0, generator=seeded),  # top-1 of a tie: a draw
            RowSampling(temperature=0.0, top_k=0, top_p=1.0, generator=seeded)]
    picked = sample(logits, rows)
    assert picked[0] == 123 and picked[2] == 0 and picked[1] in (8, 9)


def test_the_tensor_all_reduce_adds_float32_parts() -> None:
    seen: list[torch.dtype] = []

    def fake_all_reduce(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        return x * 3  # three ranks with equal parts

    reduce = _rounded(fake_all_reduce, torch.bfloat16)
    assert reduce(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.bfloat16  # a MoE block's bf16 part
    assert reduce(torch.tensor([1.0])).dtype == torch.bfloat16  # o_proj/down_proj's f32 partial sum
    assert seen == [torch.float32, torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_linear_returns_the_f32_accumulator() -> None:
    from skulk.engines.torch.matmul import cuda_linear

    x = torch.ones(2, HIDDEN, dtype=torch.bfloat16, device="cuda")
    weight = torch.full((VOCAB, HIDDEN), 20.0 / HIDDEN, dtype=torch.bfloat16, device="cuda")
    weight[HIGH, 0] += 0.03125
    logits = cuda_linear(x, weight, None, torch.float32)
    assert logits.dtype == torch.float32
    assert float(logits[0, HIGH] - logits[0, LOW]) == pytest.approx(0.03125, abs=1e-4)
