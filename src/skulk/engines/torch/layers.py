"""The building blocks of a decoder layer (the family files under models/ put them together), tensor-parallel
ready.

With tp_size > 1 each rank holds n_heads / tp_size query heads, n_kv_heads / tp_size key/value heads and
intermediate_size / tp_size MLP columns; q/k/v/gate/up are split by output rows and o_proj/down_proj by input
columns, so each rank's o_proj/down_proj output is a partial sum that all_reduce completes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels, matmul, quant
from .cache import LayerCache, MixedBatch, StepBatch
from .config import ModelArgs
from .matmul import Linear
from .quant import QuantizedLinear

AllReduce = Callable[[torch.Tensor], torch.Tensor]
Rotation = tuple[torch.Tensor, torch.Tensor]
"""A step's rope: cos and sign-folded sin for its positions. A MixedBatch step passes one per part."""


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face does, so bf16 models match the reference.

    Gemma's (unit_offset) scales by 1 + weight and casts after scaling, not before: its checkpoints store the
    weight that way, and the order changes bf16 results."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and cpu_kernels.handles(x) and cpu_kernels.available():
            return cpu_kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        if self.unit_offset:
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float() + 1.0, self.eps).to(x.dtype)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class Rope(nn.Module):
    """Rotary position embedding (half-split layout, Llama 3 or linear frequency scaling when the config asks, or
    a GGUF file's per-pair frequency factors).

    local: Gemma 3's sliding layers, which rotate with their own base and no scaling."""

    def __init__(self, args: ModelArgs, device: torch.device | str, *, local: bool = False) -> None:
        super().__init__()
        dim = args.rotary_dim or args.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        theta = args.rope_local_theta if local and args.rope_local_theta else args.rope_theta
        inv_freq = 1.0 / (theta**exponents)
        self.attention_factor = 1.0  # YaRN scales cos and sin by it
        if args.rope_scaling is not None and not local and _kind(args.rope_scaling) == "yarn":
            inv_freq, self.attention_factor = _yarn(exponents, theta, args.rope_scaling, args.max_position_embeddings)
        elif args.rope_scaling is not None and not local:
            inv_freq = _scale_frequencies(inv_freq, args.rope_scaling)
        if args.rope_freq_factors is not None and not local:  # llama.cpp's rope_freqs: theta_i / factor_i
            inv_freq = inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float32, device=device)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = None if local else args.mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for positions [B, T], shaped [B, 1, T, head_dim] to broadcast over heads.
        Multimodal rope's positions come as [3, B, T] (temporal, height, width: mrope.py): each rotary pair turns
        by the coordinate its mrope_section assigns it (transformers' recomposition_frequencies).

        The sin's first half is negated once here, so _rotate needs no negation per call (see there)."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        if positions.dim() == 3:
            assert self.mrope_section is not None, "3-D rope positions on a model without mrope_section"
            parts = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        sin, cos = emb.sin(), emb.cos()
        if self.attention_factor != 1.0:
            sin, cos = sin * self.attention_factor, cos * self.attention_factor
        sin[..., : freqs.shape[-1]].neg_()
        return cos.to(dtype), sin.to(dtype)


def _kind(scaling: dict[str, object]) -> object:
    return scaling.get("rope_type", scaling.get("type"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(exponents: torch.Tensor, base: float, scaling: dict[str, Any],
          max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek V3, gpt-oss): each frequency interpolated by `factor` or kept, ramped between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos/sin scaled by the
    attention factor. transformers' _compute_yarn_parameters, op for op, so float32 results are its own."""
    dim = exponents.shape[0] * 2
    old_ctx = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / old_ctx)
    attention = scaling.get("attention_factor")
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim \
            else yarn_mscale(factor)
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(exponents.device)
    pos_freqs = base**exponents
    keep = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention)


def _scale_frequencies(inv_freq: torch.Tensor, scaling: dict[str, object]) -> torch.Tensor:
    """Llama 3.1+ rope scaling: slow down low frequencies, keep high ones, interpolate between. Linear
    (Gemma 3's global layers): every frequency divided by the factor."""
    kind = _kind(scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[arg-type]
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # type: ignore[arg-type]
    old_ctx = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) as roll(x) = cat(x2, x1) times a sin
    whose first half is negated: the same products bit for bit, in 4 ops instead of 7 (48 calls a step).
    A rope narrower than the head (partial rotary) turns the head's first dimensions and passes the rest."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((_rotate(x[..., :dim], cos, signed_sin), x[..., dim:]), dim=-1)
    return x * cos + x.roll(dim // 2, -1) * signed_sin


class Attention(nn.Module):
    """Attention over the paged cache. unit_offset: the q/k norms scale by 1 + weight (Gemma's)."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, unit_offset: bool = False) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads // tp_size
        self.n_kv_heads = args.num_key_value_heads // tp_size
        self.head_dim = args.head_dim
        self.rotary_dim = args.rotary_dim or args.head_dim
        hidden, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, unit_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, unit_offset) if args.qk_norm else None
        self.scale = args.query_pre_attn_scalar**-0.5 if args.query_pre_attn_scalar else None
        self.softcap = args.attn_logit_softcapping
        self.all_reduce = all_reduce
        self.qkv: nn.Module | None = None  # q, k and v stacked (fuse_projections), when they can be
        self.sizes = [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch, rope: Rotation | tuple[Rotation, ...],
                cache: LayerCache) -> torch.Tensor:
        b, t, _ = x.shape
        if isinstance(batch, MixedBatch):
            out = self._attend_mixed(x, batch, cast(tuple[Rotation, ...], rope), cache)
        elif t == 1 and self._decodes_on_kernels(x, cache):
            out = self._decode(x, batch, cast(Rotation, rope), cache).transpose(1, 2)
        else:
            out = self._attend(self._project(x), batch, cast(Rotation, rope), cache).transpose(1, 2)
        return self.all_reduce(self.o_proj(out.reshape(b, t, -1)))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(self.sizes, dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _attend_mixed(self, x: torch.Tensor, batch: MixedBatch, ropes: tuple[Rotation, ...],
                      cache: LayerCache) -> torch.Tensor:
        """A MixedBatch: q/k/v of every row in one projection, then each part's attention on its own rows."""
        sizes = batch.sizes
        parts = zip(*(t.split(sizes, dim=1) for t in self._project(x)), batch.parts, ropes, strict=True)
        outs = []
        for q, k, v, part, rope in parts:
            rows, t = part.positions.shape
            shaped = (q.reshape(rows, t, -1), k.reshape(rows, t, -1), v.reshape(rows, t, -1))
            outs.append(self._attend(shaped, part, rope, cache).transpose(1, 2).reshape(1, rows * t, -1))
        return torch.cat(outs, dim=1)

    def _attend(self, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch: StepBatch, rope: Rotation,
                cache: LayerCache) -> torch.Tensor:
        """Any step in torch ops from its projections: q, k, v [B, heads, T, D], rope, the cache write, attention
        under the step's mask; returns [B, heads, T, D]."""
        q, k, v = qkv
        b, t, _ = q.shape
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        keys, values = cache.update(k, v, batch)
        return self._attention(q, keys, values, batch.mask)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale) v under the mask, [B, heads, T, D]: a family with another softmax (gpt-oss's
        sinks) overrides this."""
        if self.softcap:
            return _softcapped_attention(q, keys, values, mask, self.scale, self.softcap)
        if q.dtype == torch.float16 and q.device.type == "cpu":  # torch's f16 attention on the CPU: 2x f32's time
            out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                                 scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads
        )

    def _decode(
        self, x: torch.Tensor, batch: StepBatch, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache
    ) -> torch.Tensor:
        """A decode step (one token per row) on the CPU kernels: the same arithmetic as _attend in three calls
        (stacked projection; norms, rope and cache write; attention) instead of ~30 torch ops."""
        keys, values = cache.keys, cache.values
        norms, eps, unit = None, 0.0, False
        if self.q_norm is not None and self.k_norm is not None:
            norms, eps, unit = (self.q_norm.weight, self.k_norm.weight), self.q_norm.eps, self.q_norm.unit_offset
        assert self.qkv is not None
        q = cpu_kernels.qkv_rope(self.qkv(x), self.n_heads, self.n_kv_heads, self.head_dim, rope, norms, eps, unit,
                                 batch.positions, batch.tables, keys, values)
        return cpu_kernels.decode_attention(q, keys, values, batch.positions, batch.tables, batch.window,
                                            self.scale or self.head_dim**-0.5)

    def _decodes_on_kernels(self, x: torch.Tensor, cache: LayerCache) -> bool:
        """Whether _decode can run: stacked q/k/v, no score softcapping, rope over the whole head, the kernels
        loaded, one dtype throughout."""
        if self.qkv is None or self.softcap or self.head_dim % 8 or self.head_dim > 512 \
                or self.rotary_dim != self.head_dim:
            return False
        if self.q_norm is not None and self.q_norm.weight.dtype != x.dtype:
            return False
        return x.dtype == cache.keys.dtype and cpu_kernels.handles(x) and cpu_kernels.available()


def _softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                          scale: float | None, cap: float) -> torch.Tensor:
    """Attention whose scores pass through cap * tanh(score / cap) before the softmax, which fused attention
    cannot do (configs with attn_logit_softcapping: Gemma 2 style; Gemma 3 ships it off)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (q @ keys.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).to(values.dtype)) @ values


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP's math and each MoE expert's (moe.Expert). fuse_projections
    stacks gate and up into one linear, one matmul call instead of two, which is most of an expert's cost in a
    decode step (a few rows each)."""

    def __init__(self, hidden: int, inter: int, gelu: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.gelu = gelu  # Gemma's gate is GELU (tanh approximation), everyone else's SiLU
        self.gate_up: nn.Module | None = None  # gate and up stacked (fuse_projections), when they can be
        self.inter = inter

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and cpu_kernels.handles(x) and cpu_kernels.available():
            return self.down_proj(cpu_kernels.act_mul(self.gate_up(x), self.gelu))
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split([self.inter, self.inter], dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gated(x)


class MLP(GatedMLP):
    """The dense block: a tensor-parallel rank holds intermediate_size / tp_size of it and all-reduces."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, gelu: bool = False) -> None:
        super().__init__(args.hidden_size, args.intermediate_size // tp_size, gelu=gelu)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.gated(x))


def softcap_logits(logits: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """cap * tanh(logits / cap) when the config sets final_logit_softcapping (Gemma's family file reads it)."""
    cap = args.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual. mlp: a dense MLP or a sparse MoE block.

    sliding: the layer attends through the config's sliding window (the model hands it the windowed mask).
    attention: a family's own (DeepSeek's latent attention, gpt-oss's sinks); such a layer never runs on the
    C layer kernel, which computes Attention's math only."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce, mlp: nn.Module | None = None,
                 sliding: bool = False, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.sliding = sliding
        self.self_attn = attention if attention is not None else Attention(args, tp_size, all_reduce)
        self.mlp = mlp if mlp is not None else MLP(args, tp_size, all_reduce)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self._native: tuple[cpu_kernels.LayerDesc, torch.dtype] | bool | None = None if attention is None else False
        """The C kernel's description of the layer; None: not yet decided, False: it runs as separate steps."""

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch, rope: Rotation | tuple[Rotation, ...],
                cache: LayerCache) -> torch.Tensor:
        if (isinstance(batch, StepBatch) and x.shape[1] == 1 and cpu_kernels.handles(x)
                and (desc := self.native(x.dtype, cache)) is not None):
            return cpu_kernels.decode_layer(desc, x, batch.positions, cast(Rotation, rope), batch.window, batch.tables,
                                            cache.keys, cache.values)
        h, normed = add_norm(x, self.self_attn(self.input_layernorm(x), batch, rope, cache),
                             self.post_attention_layernorm)
        return h + self.mlp(normed)

    def native(self, dtype: torch.dtype, cache: LayerCache) -> cpu_kernels.LayerDesc | None:
        """The layer as one skulk_decode_layer call for a decode step on activations of `dtype` and this cache,
        or None where it runs as separate steps."""
        native = self._native if self._native is not None else self._describe()
        return native[0] if isinstance(native, tuple) and dtype == native[1] == cache.keys.dtype else None

    def _describe(self) -> tuple[cpu_kernels.LayerDesc, torch.dtype] | bool:
        """The layer as skulk_decode_layer reads it (decided once, after loading): the same steps as forward's
        torch path in one call, so a decode step pays Python once per layer, not ~20 times. The MLP is a dense one
        or a sparse MoE block whose routing and experts cpu_moe.c runs (moe.SparseMoe.layer_kernel). False where it
        does not apply: a tensor-parallel rank (its all-reduces sit between the steps), another MoE block, CUDA
        weights, partial rotary, or projections that did not stack."""
        attn, mlp_part = self.self_attn, self._describe_mlp()
        if not isinstance(attn, Attention) or mlp_part is None:
            self._native = False
            return False
        matrices = [kernel_matrix(m) for m in (attn.qkv, attn.o_proj)]
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        if attn.q_norm is not None and attn.k_norm is not None:
            norms += [attn.q_norm.weight, attn.k_norm.weight]
        usable = (attn.all_reduce is identity and not attn.softcap and attn.head_dim % 8 == 0 and attn.head_dim <= 512
                  and attn.rotary_dim == attn.head_dim and len({w.dtype for w in norms}) == 1
                  and norms[0].dtype in _KERNEL_DTYPES)
        if not usable or any(m is None for m in matrices):
            self._native = False
            return False
        qkv, o = (m.describe() for m in matrices)  # type: ignore[union-attr]
        gate_up, down, inter, gelu, moe = mlp_part
        q_norm, k_norm = (norms[2].data_ptr(), norms[3].data_ptr()) if len(norms) == 4 else (None, None)
        desc = cpu_kernels.LayerDesc(
            qkv, o, gate_up, down, norms[0].data_ptr(), norms[1].data_ptr(), q_norm, k_norm,
            cpu_kernels.type_code(norms[0].dtype), attn.n_heads, attn.n_kv_heads, attn.head_dim,
            self.input_layernorm.weight.shape[0], inter, gelu, 0, self.input_layernorm.eps,
            attn.q_norm.eps if attn.q_norm is not None else 0.0, attn.scale or attn.head_dim**-0.5, moe)
        self._native = (desc, norms[0].dtype)
        return self._native

    def _describe_mlp(self) -> tuple[cpu_kernels.MatrixDesc, cpu_kernels.MatrixDesc, int, int, int | None] | None:
        """(gate_up, down, intermediate size, gelu, MoE description's address) of the layer's MLP for
        skulk_decode_layer: a dense MLP's matrices, or a sparse MoE block's kernel (the dense fields left empty);
        None when neither runs there."""
        mlp = self.mlp
        if isinstance(mlp, MLP):
            gate_up, down = kernel_matrix(mlp.gate_up), kernel_matrix(mlp.down_proj)
            if gate_up is None or down is None:
                return None
            return gate_up.describe(), down.describe(), mlp.inter, int(mlp.gelu), None
        layer_kernel = getattr(mlp, "layer_kernel", None)  # moe.SparseMoe's (moe.py imports this module)
        kernel = layer_kernel() if callable(layer_kernel) else None
        if not isinstance(kernel, cpu_kernels.MoeKernel):
            return None
        return cpu_kernels.MatrixDesc(), cpu_kernels.MatrixDesc(), 0, 0, kernel.address

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_matrix(module: nn.Module | None) -> cpu_kernels.HalfMatrix | cpu_kernels.QuantMatrix | None:
    """A projection as the kernels read it, or None when it runs elsewhere (CUDA weights, torch's quantized
    layout, a tensor-parallel partial sum)."""
    if module is None or getattr(module, "out_dtype", None) is not None or not cpu_kernels.available():
        return None
    if type(module) is Linear and module.weight.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and module.weight.device.type == "cpu":
        return module._matrix()
    if isinstance(module, QuantizedLinear) and module.kernel:
        return module.kernel_matrix()
    return None


def add_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) for the residual h = x + delta: one kernel call where the kernels run."""
    if x.dtype == delta.dtype == norm.weight.dtype and cpu_kernels.handles(x) and cpu_kernels.available():
        return cpu_kernels.add_rms_norm(x, delta, norm.weight, norm.eps, norm.unit_offset)
    h = x + delta
    return h, norm(h)


def fuse_projections(model: nn.Module) -> None:
    """Stack each attention's q/k/v and each MLP's and expert's gate/up into one linear (same math, the parts'
    outputs side by side): per layer three matmul calls instead of five, which is most of a decode step's per-call
    overhead on the CPU. Parts that cannot stack (different dtypes or layouts) stay separate."""
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.qkv = _stacked([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, GatedMLP):
            module.gate_up = _stacked([module.gate_proj, module.up_proj])


def _stacked(parts: list[nn.Module]) -> nn.Module | None:
    if all(type(p) is Linear for p in parts):
        return matmul.stack_rows(parts)  # type: ignore[arg-type]
    if all(isinstance(p, QuantizedLinear) for p in parts):
        return quant.stack_rows(parts)  # type: ignore[arg-type]
    return None
