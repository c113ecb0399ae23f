"""Our AVX2 kernels (engines/torch/cpu_matmul.c, cpu_step.c) against torch's arithmetic for the same inputs:
matrix-vector products on f16/bf16 and MLX 4/8-bit weights at every row count a tile boundary can split, RMSNorm,
decode attention; the stacked q/k/v and gate/up projections; the one-call decode layer; the AMX kernel against the
VNNI ones, bit for bit; and the torch fallback when the kernels are off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.cache import MixedBatch, StepBatch
from skulk.engines.torch.layers import RMSNorm
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.quant import QuantizedLinear, affine_quantize, dequantize
from tests.unit.test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

pytestmark = [
    pytest.mark.slow,  # compiles kernels and runs real model compute: `make test`, not `make test-fast`
    pytest.mark.skipif(not cpu_kernels.available(), reason="needs an AVX2/FMA/F16C CPU and a C compiler"),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xdtype", DTYPES)
def test_half_matrix_matches_f32_linear_for_every_row_count(wdtype: torch.dtype, xdtype: torch.dtype,
                                                            extensions: bool) -> None:
    # 101 rows: blocks of 32 and a rest of 5 (pairs of weight rows and a last one); 203 columns: 8s and a rest of 3
    # (16s and a rest of 11 for bf16 x bf16 on AVX-512 BF16, in tiles of 8 rows)
    weight = (torch.randn(101, 203, generator=_gen(0)) * 0.05).to(wdtype)
    bias = torch.randn(101, generator=_gen(1)).to(wdtype)
    matrix = cpu_kernels.HalfMatrix(weight, bias)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 17):
        x = torch.randn(rows, 203, generator=_gen(rows)).to(xdtype)
        expected = F.linear(x.float(), weight.float(), bias.float())
        got = matrix(x)
        assert got.dtype == xdtype and got.shape == (rows, 101)
        assert relative(got, expected) < {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[xdtype]
        assert torch.allclose(matrix(x, torch.float32), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(params=[False, True], ids=["avx2", "extensions"])
def extensions(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The kernels built for AVX2 alone (every such CPU's path) and with this CPU's extensions beyond it (VNNI,
    AVX-512 BF16), where it has any."""
    cpu_kernels.set_enabled(True, extensions=request.param)
    try:
        if request.param and not cpu_kernels.extension_flags():
            pytest.skip("this CPU has no AVX-512 VNNI or AVX-VNNI")
        yield request.param
    finally:
        cpu_kernels.set_enabled(True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_quant_matrix_matches_the_dequantized_weights(bits: int, group: int, extensions: bool) -> None:
    """Activations are quantized to int8 per group inside the kernel: the error against x @ dequantized.T stays
    near int8's resolution (at most 0.4 % here; truncating instead of rounding makes it 0.8 %). Row counts cross
    the tiles of both builds (4 rows without VNNI, 8 with)."""
    weight = torch.randn(70, group * 3, generator=_gen(bits + group)) * 0.02
    q, scales, biases = affine_quantize(weight, bits, group)
    layer = QuantizedLinear.from_affine(q, scales, biases, bits, group, bias=torch.randn(70, generator=_gen(2)))
    assert layer.kernel
    reference = dequantize(q, scales.half(), biases.half(), group)
    for rows in (1, 4, 5, 8, 11, 19):
        for dtype in DTYPES:
            x = torch.randn(rows, group * 3, generator=_gen(rows)).to(dtype)
            expected = F.linear(x.float(), reference, layer.bias)
            got = layer(x)
            assert got.dtype == dtype and relative(got, expected) < 0.006, (rows, dtype)
            # a row's output is the same bits whatever its batch-mates: one row takes the 256-bit kernel, two or
            # more the 512-bit one on an AVX-512 VNNI CPU (two blocks of 8 weight rows per vector, an odd last
            # block through the 256-bit one: 70 rows are 9 blocks)
            assert torch.equal(got[:1], layer(x[:1])), (rows, dtype)


@pytest.fixture
def amx() -> Iterator[int]:
    """The AMX kernel's row threshold, restored after the test; skipped where the kernel does not run."""
    rows = cpu_kernels.amx_rows()
    if not rows:
        reason = ("this CPU has no AMX-INT8" if not cpu_kernels.amx_flags() else
                  "the AMX kernel is off (SKULK_AMX=0, a gcc without -mamx-int8, or Linux refused the tile state)")
        pytest.skip(reason)
    try:
        yield rows
    finally:
        cpu_kernels.amx_rows(rows)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_the_amx_kernel_is_the_vnni_kernels_bit_for_bit(bits: int, group: int, amx: int) -> None:
    """cpu_amx.c's tiles give exactly the VNNI kernels' outputs: integer sums per group, then their float operations
    in their order. Output rows 70 (9 blocks: units of 4 and an odd last block, alone in its pair) and 24 (3: an
    odd block beside a pair); K past one 512-column span, its last span partial; row counts around the 16-row tiles."""
    columns = group * (3 + 1024 // group)
    for n in (70, 24):
        weight = torch.randn(n, columns, generator=_gen(n + bits + group)) * 0.02
        layer = QuantizedLinear.from_affine(*affine_quantize(weight, bits, group), bits, group,
                                            bias=torch.randn(n, generator=_gen(3)))
        for rows in (1, 8, 16, 17, 32, 64):
            x = torch.randn(rows, columns, generator=_gen(rows))
            cpu_kernels.amx_rows(1)
            tiles = layer(x)
            cpu_kernels.amx_rows(1 << 30)
            assert torch.equal(tiles, layer(x)), (n, rows)


def test_the_amx_kernel_leaves_a_models_logits_unchanged(qwen: Path, amx: int) -> None:
    """A 20-token prefill and decode steps of an int4 model (8 bits: the test above), every matmul on AMX tiles or
    none: the same logits, bit for bit."""
    model = load_model(qwen, quantize="int4")
    cpu_kernels.amx_rows(1)
    tiles = _logits(model)
    cpu_kernels.amx_rows(1 << 30)
    for got, expected in zip(tiles, _logits(model), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_rounds_where_the_torch_path_does(dtype: torch.dtype, unit_offset: bool) -> None:
    norm = RMSNorm(96, 1e-6, unit_offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=_gen(3)))
    norm = norm.to(dtype)
    x = (torch.randn(5, 96, generator=_gen(4)) * 3).to(dtype)
    got = cpu_kernels.rms_norm(x, norm.weight, norm.eps, unit_offset)
    try:
        cpu_kernels.set_enabled(False)
        expected = norm(x)
    finally:
        cpu_kernels.set_enabled(True)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert torch.allclose(got.float(), expected.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dim", [64, 120, 256])
@pytest.mark.parametrize("heads", [2, 6, 8, 16])
def test_decode_attention_matches_sdpa_with_the_step_mask(dtype: torch.dtype, window: int, dim: int, heads: int,
                                                          extensions: bool) -> None:
    """Three rows at different positions (keys in blocks of 4 and a rest), a cache longer than any row; 1, 3, 4 and
    8 query heads per kv head (a tile of heads, one cut short, several); head dims that the weighted sum covers in
    32s and 8s (120 also misses bf16's 16s)."""
    slots, kv_heads, max_seq = 4, 2, 40
    keys = torch.randn(slots, kv_heads, max_seq, dim, generator=_gen(5)).to(dtype)
    values = torch.randn(slots, kv_heads, max_seq, dim, generator=_gen(6)).to(dtype)
    q = torch.randn(3, heads, 1, dim, generator=_gen(7)).to(dtype)
    positions = torch.tensor([[12], [3], [30]])
    batch = StepBatch.build(positions, 1, kv_len=31)
    mask = batch.mask
    if window:
        near = torch.arange(31).view(1, 1, 1, -1) > positions.view(3, 1, 1, 1) - window
        mask = mask & near
    expected = F.scaled_dot_product_attention(
        q.float(), keys[1:4, :, :31].float(), values[1:4, :, :31].float(), attn_mask=mask, enable_gqa=True)
    got = cpu_kernels.decode_attention(q, keys, values, positions, batch.tables, window, dim**-0.5)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert got.dtype == dtype and torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance)
    for block in (4, 8, 5):  # the same cache paged: blocks scattered over a pool (5: blocks cut 4-key groups)
        pool_k, pool_v, tables = paged(keys, values, block)
        paged_out = cpu_kernels.decode_attention(q, pool_k, pool_v, positions, tables[1:4], window, dim**-0.5)
        assert torch.allclose(paged_out.float(), got.float(), rtol=tolerance, atol=tolerance)


def paged(keys: torch.Tensor, values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A contiguous cache [slots, Hkv, max_seq, D] as a paged one: each slot's positions in blocks of `block`, the
    blocks in a shuffled order over a pool with a spare block; returns the pools and each slot's block table."""
    slots, kv_heads, max_seq, dim = keys.shape
    per_slot = -(-max_seq // block)
    order = torch.randperm(slots * per_slot + 1, generator=_gen(9))
    pool_k = torch.zeros(slots * per_slot + 1, kv_heads, block, dim, dtype=keys.dtype)
    pool_v = torch.zeros_like(pool_k)
    tables = order[: slots * per_slot].view(slots, per_slot).to(torch.int32)
    for s in range(slots):
        for j in range(per_slot):
            part = slice(j * block, min((j + 1) * block, max_seq))
            rows = part.stop - part.start
            pool_k[tables[s, j], :, :rows] = keys[s, :, part]
            pool_v[tables[s, j], :, :rows] = values[s, :, part]
    return pool_k, pool_v, tables


FAMILIES = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B", "google/gemma-3-1b-it")
"""q/k/v biases and tied embeddings; per-head q/k norms; Gemma's unit-offset norms, GELU and sliding window."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {model_id: write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), root / model_id.split("/")[1])
            for model_id in FAMILIES}


@pytest.fixture
def qwen(checkpoints: dict[str, Path]) -> Path:
    return checkpoints[FAMILIES[0]]


def _logits(model: torch.nn.Module, steps: int = 4) -> list[torch.Tensor]:
    """A 20-token prefill then single-row decode steps (the kernels' path; past Gemma's window of 16), greedy."""
    cache = model.make_cache(1, 32)  # type: ignore[operator]
    ids, pos, seen = torch.arange(3, 23).unsqueeze(0) * 7 % 200, torch.arange(20).unsqueeze(0), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(ids, StepBatch.build(pos, 0), cache)[:, -1]
            seen.append(logits)
            ids, pos = logits.argmax(-1, keepdim=True), pos[:, -1:] + 1
    return seen


@pytest.mark.parametrize("options", [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"quantize": "int4"},
                                     {"quantize": "int8"}])
def test_stacked_projections_compute_what_the_separate_ones_do(qwen: Path, options: dict[str, str]) -> None:
    model = load_model(qwen, **options)
    attention = model.layers["0"].self_attn  # type: ignore[union-attr]
    mlp = model.layers["0"].mlp  # type: ignore[union-attr]
    assert attention.qkv is not None and mlp.gate_up is not None
    assert attention.q_proj.weight.untyped_storage().data_ptr() == attention.qkv.weight.untyped_storage().data_ptr()
    for rows in (1, 3):
        x = torch.randn(rows, 1, model.args.hidden_size, generator=_gen(rows)).to(model.args.dtype)
        with torch.inference_mode():
            parts = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
            assert torch.equal(attention.qkv(x), torch.cat(parts, dim=-1))
            assert torch.equal(mlp.gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))


def test_a_compiler_that_rejects_the_extension_flags_still_builds_the_avx2_kernels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gcc too old for -mavxvnni (or any flag extension_flags adds) leaves the AVX2 build, not torch's path."""
    monkeypatch.setattr(cpu_kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_kernels, "extension_flags", lambda: ("-mno-such-instruction-set",))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
        assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1
    finally:
        cpu_kernels.library.cache_clear()


@pytest.fixture
def kernels_off() -> Iterator[None]:
    cpu_kernels.set_enabled(False)
    try:
        yield
    finally:
        cpu_kernels.set_enabled(True)


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"dtype": "float16"}, {"dtype": "bfloat16"},
                                     {"quantize": "int4"}, {"quantize": "int8"}])
@pytest.mark.parametrize("model_id", FAMILIES)
def test_without_the_kernels_torch_computes_the_same_model(checkpoints: dict[str, Path], model_id: str,
                                                           options: dict[str, str], kernels_off: None) -> None:
    """Kernels off (as on a CPU or machine they cannot build for): torch's ops, kernels and layouts for the
    whole decode step. Float weights: the same logits within rounding. Quantized: the two are different
    approximations (ours quantizes activations per group, torch's int8 scales weights per row), so each is
    measured against the float model, and ours is no further from it than torch's."""
    fallback = load_model(checkpoints[model_id], **options)
    assert not cpu_kernels.available()
    if "quantize" in options:
        assert not fallback.layers["0"].mlp.down_proj.kernel  # type: ignore[union-attr]
    theirs = _logits(fallback)
    reference = _logits(load_model(checkpoints[model_id], dtype="float32")) if "quantize" in options else theirs
    cpu_kernels.set_enabled(True)
    ours = _logits(load_model(checkpoints[model_id], **options))
    if "quantize" in options:
        for got, their, exact in zip(ours, theirs, reference, strict=True):
            assert relative(got, exact) <= 1.1 * relative(their, exact) + 0.005
    else:
        bound = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 0.03}[options["dtype"]]
        for got, their in zip(ours, theirs, strict=True):
            assert relative(got, their) < bound


@pytest.mark.parametrize("options", [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"quantize": "int4"},
                                     {"quantize": "int8"}])
@pytest.mark.parametrize("model_id", FAMILIES[:2])
def test_one_call_decode_layer_is_the_per_step_calls(checkpoints: dict[str, Path], model_id: str,
                                                     options: dict[str, str]) -> None:
    """skulk_decode_layer runs the same kernels in the same order as DecoderLayer's own calls: identical logits,
    batched rows at different positions included."""
    model = load_model(checkpoints[model_id], **options)
    native = _logits(model)
    layers = list(model.layers.values())
    assert all(isinstance(layer._native, tuple) for layer in layers)  # type: ignore[union-attr]
    for layer in layers:
        layer._native = False  # type: ignore[union-attr]
    for got, expected in zip(native, _logits(model), strict=True):
        assert torch.equal(got, expected)


def _batched_logits(model: torch.nn.Module, steps: int = 5) -> list[torch.Tensor]:
    """Three requests prefilled on their own into slots 1-3 (9, 18 and 21 tokens), then decoded together."""
    cache = model.make_cache(4, 32)  # type: ignore[operator]
    lengths, seen, last = (9, 18, 21), [], []
    with torch.inference_mode():
        for slot, length in enumerate(lengths, start=1):
            ids = (torch.arange(length).unsqueeze(0) * (slot + 3)) % 200
            last.append(model(ids, StepBatch.build(torch.arange(length).unsqueeze(0), slot), cache)[:, -1])
        ids, pos = torch.cat(last).argmax(-1, keepdim=True), torch.tensor(lengths).unsqueeze(1)
        for _ in range(steps):
            logits = model(ids, StepBatch.build(pos, 1), cache)[:, -1]
            seen.append(logits)
            ids, pos = logits.argmax(-1, keepdim=True), pos + 1
    return seen


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"dtype": "bfloat16"}, {"quantize": "int4"},
                                     {"quantize": "int8"}])
def test_one_call_layer_stack_is_the_per_step_calls(tmp_path: Path, options: dict[str, str]) -> None:
    """A decode step through every layer in one call (skulk_decode_layers): identical logits to the torch path for
    rows at different positions in cache slots past the first, through Mistral's sliding window."""
    model_id = "mistralai/Mistral-7B-v0.1"
    model = load_model(write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), tmp_path / "m"), **options)
    assert model.windowed and model.args.sliding_window is not None and model.args.sliding_window < 18
    native = _batched_logits(model)
    assert model._stack is not None and model._stack[2] is not None  # the one-call stack ran
    for layer in model.layers.values():
        layer._native = False  # type: ignore[union-attr]
    per_step = _batched_logits(model)
    assert model._stack is not None and model._stack[2] is None
    for got, expected in zip(native, per_step, strict=True):
        assert torch.equal(got, expected)


def _mixed_logits(model: torch.nn.Module, tail: int) -> list[torch.Tensor]:
    """The engine's mixed step: slots 1 and 2 decode (9 and 18 tokens in) while slot 3, whose first 17 prompt
    tokens are cached (a reused prefix), prefills its last `tail` in the same forward; slot 3's decode row is a
    placeholder the chunk overwrites, as engine._mixed builds it. Then all three decode one step together, which
    reads the chunk's cache entries."""
    cache = model.make_cache(4, 64)  # type: ignore[operator]
    prompts = [(torch.arange(n).unsqueeze(0) * (slot + 3)) % 200 for slot, n in ((1, 9), (2, 18), (3, 17 + tail))]
    with torch.inference_mode():
        firsts = [model(ids[:, :n], StepBatch.build(torch.arange(n).unsqueeze(0), slot), cache)[:, -1]
                  for slot, ids, n in ((1, prompts[0], 9), (2, prompts[1], 18), (3, prompts[2], 17))]
        decode = StepBatch.build(torch.tensor([[9], [18], [17]]), 1)
        chunk = StepBatch.build(torch.arange(17, 17 + tail).unsqueeze(0), 3)
        ids = torch.cat([torch.cat(firsts[:2]).argmax(-1), torch.zeros(1, dtype=torch.long), prompts[2][0, 17:]])
        mixed = model(ids.unsqueeze(0), MixedBatch((decode, chunk)), cache)[0]
        following = mixed[[0, 1, 2 + tail]].argmax(-1, keepdim=True)
        after = model(following, StepBatch.build(torch.tensor([[10], [19], [17 + tail]]), 1), cache)[:, -1]
    return [mixed[[0, 1, *range(3, 3 + tail)]], after]


@pytest.mark.parametrize("tail", [4, 40])  # 7 rows, and 43 (past the 16 rows where matmuls turn to the GEMM)
@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"quantize": "int4"}])
def test_a_short_mixed_step_runs_through_the_layer_stack(tmp_path: Path, options: dict[str, str], tail: int) -> None:
    """Decode rows and a prefill chunk under MIXED_STACK_ROWS go through the one-call stack as rows with their own
    slots (the chunk's tokens share one); logits match the per-layer path's (whose chunk attention is torch's, so
    close rather than equal), and the next step, reading what the chunk wrote, does too."""
    model_id = "Qwen/Qwen3-0.6B"
    model = load_model(write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), tmp_path / "m"), **options)
    native = _mixed_logits(model, tail)
    assert model._stack is not None and model._stack[2] is not None
    for layer in model.layers.values():
        layer._native = False  # type: ignore[union-attr]
    per_layer = _mixed_logits(model, tail)
    assert model._stack is not None and model._stack[2] is None
    for got, expected in zip(native, per_layer, strict=True):  # a 40-token chunk's bf16 SDPA drifts further
        assert relative(got, expected) < (1e-2 if tail < 16 else 2e-2)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
