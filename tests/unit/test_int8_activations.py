"""The quantized kernels' only approximation is their design's: each activation row quantized to int8 per group
(symmetric, round to nearest). Against that design emulated in float the kernel is exact to f32 rounding, so the
gap to a float matmul (about 0.5 % per product) is the int8 activations, as in llama.cpp's Q8_0/Q8_1 activations
for its Q4/Q8 dot products, not an arithmetic error. (This settled the "L'Étoile" note of issue 31: the answer
was a near tie that the int8 activations' rounding can tip either way; on main the default model answers "The
capital of France is Paris." on every path.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.quant import QuantizedLinear, affine_quantize, dequantize

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cpu_kernels.available(), reason="needs an AVX2/FMA/F16C CPU and a C compiler"),
]


def int8_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel sees it: per group of `group` columns, scale d = max|x| / 127, values round(x * (1/d))."""
    grouped = x.float().reshape(x.shape[0], -1, group)
    d = grouped.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(grouped * inverse) * d).reshape(x.shape)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
def test_the_kernel_is_its_int8_activation_design_exactly(bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(bits + group)
    weight = torch.randn(96, group * 8, generator=gen) * 0.02
    q, scales, biases = affine_quantize(weight, bits, group)
    scales, biases = scales.half(), biases.half()  # f16 parameters, as a GGUF file and the kernels keep them
    layer = QuantizedLinear.from_affine(q, scales.float(), biases.float(), bits, group, bias=None)
    assert layer.kernel
    exact = dequantize(q, scales, biases, group)
    for rows in (1, 5, 9):
        x = torch.randn(rows, group * 8, generator=gen)
        got = layer(x)
        assert relative(got, F.linear(int8_activations(x, group), exact)) < 1e-6, rows
        assert 1e-3 < relative(got, F.linear(x, exact)) < 0.01, "the int8 activations' own rounding, and only it"
