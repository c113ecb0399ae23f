"""Qwen3-Next (Qwen3-Next-80B-A3B): a pre-norm decoder whose layers mix two token mixers, every one followed by a
sparse MoE with a gated shared expert (transformers' modeling_qwen3_next is the reference, op for op).

- `full_attention` layers (every full_attention_interval-th): gated attention over the paged KV cache. q_proj
  gives each head its query and a gate side by side; the attention's output is multiplied by sigmoid(gate)
  before o_proj. q/k RMSNorm scale by 1 + weight, and rope turns only the first partial_rotary_factor of each
  head (a quarter on the released checkpoints).
- `linear_attention` layers: gated DeltaNet. in_proj_qkvz gives per key head its q, k and its value heads' v and
  z; in_proj_ba their b (the write strength, beta = sigmoid(b)) and a (the decay, g = -exp(A_log) *
  softplus(a + dt_bias)). q, k and v pass a causal depthwise conv (kernel linear_conv_kernel_dim) with SiLU, q
  and k are L2-normalised, and the gated delta rule updates a [k_dim, v_dim] matrix per value head; its reading
  passes an RMSNorm gated by SiLU(z), then out_proj.

Every norm of the decoder (input, post-attention, final) scales by 1 + weight (Family.norm_unit_offset).

A linear layer's past is not KV rows but a state of constant size per stream: the conv's last kernel - 1 inputs
and the recurrent matrices (float32, as transformers keeps them). StreamStates holds them per layer, in a pool of
slots, keyed by the stream's first KV block (every rank's block tables are the same, and with prefix sharing off,
a running request's first block is its own): a stream starting at position 0 starts from zeros (an admission, or
a preempted request's recompute); a step from position p reads the state the stream had after p positions. A
step's result goes to a fresh slot beside the one it read, so a step the engine drops (a decode row of a request
still being prefilled: its chunk then starts again at the same position) leaves the state it read intact. The
engine frees a stream's slots when its blocks go back (Scheduler.on_free, family.forget_stream). For the same
reason the family is `stateful`: no prefix sharing (a shared block carries no state) and no speculative decoding
(a rejected draft would leave the state past the accepted tokens). The linear layers' KV pools hold no block
(ModelSlice._stateful). A decoding stream holds two slots per linear layer, the recurrent matrices float32: on
Qwen3-Next-80B 154.5 MB a stream, what placement counts a torch rank's stream (memory_math.torch_state_bytes; one
state, its recurrent matrices float32 there too, 77.3 MB, on MLX).

A pipeline stage holds its layers whole, and its linear layers' states. Tensor parallel: attention heads and
expert widths split as every family's do; a linear layer's key heads (with their value heads) split the same way,
each rank keeping its heads' states, and the shared expert's width splits like the experts'.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import LayerCache, MixedBatch, StepBatch
from ..config import DeltaNetShape, ModelArgs
from ..layers import MLP, AllReduce, Attention, RMSNorm, Rotation, add_norm
from ..matmul import Linear
from ..moe import Expert, SparseMoe
from .family import Family

LINEAR = "linear_attention"
CHUNK = 64
"""The gated delta rule's chunk (transformers' torch_chunk_gated_delta_rule default)."""


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3NextConfig's fields with its defaults: partial_rotary_factor under rope_parameters (transformers 5)
    or at the top (hub configs), layer_types or else every full_attention_interval-th layer full."""
    n = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    factor = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))
    head_dim = int(cfg.get("head_dim") or 256)
    types = cfg.get("layer_types")
    if not types:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else "full_attention" for i in range(n)]
    experts = int(cfg.get("num_experts", 512))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return {
        "head_dim": head_dim,
        "qk_norm": True,
        "rotary_dim": int(head_dim * factor),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 10)),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 512)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "sparse_layers": sparse,
        "delta_net": DeltaNetShape(
            linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
            num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
            num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
            head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
            head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 512)),
        ),
    }


def _shape(args: ModelArgs) -> DeltaNetShape:
    assert args.delta_net is not None, "a Qwen3-Next layer without its delta_net shape"
    return args.delta_net


class GatedAttention(Attention):
    """layers.Attention with Qwen3-Next's output gate: q_proj's rows are, per head, its query then its gate
    (fuse_projections stacks q/k/v as for any attention, the q part twice as wide); q/k norms scale by 1 + weight."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__(args, tp_size, all_reduce, unit_offset=True)
        self.q_proj = Linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.attention_bias)
        self.sizes[0] = 2 * self.n_heads * self.head_dim

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch, rope: Rotation | tuple[Rotation, ...],
                cache: LayerCache) -> torch.Tensor:
        b, t, _ = x.shape
        q_gate, k, v = self._project(x)
        q, gate = q_gate.view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(b, t, -1)
        if isinstance(batch, MixedBatch):
            outs = []
            for q_, k_, v_, part, r in zip(q.split(batch.sizes, 1), k.split(batch.sizes, 1), v.split(batch.sizes, 1),
                                           batch.parts, cast(tuple[Rotation, ...], rope), strict=True):
                rows, n = part.positions.shape
                shaped = (q_.reshape(rows, n, -1), k_.reshape(rows, n, -1), v_.reshape(rows, n, -1))
                outs.append(self._attend(shaped, part, r, cache).transpose(1, 2).reshape(1, rows * n, -1))
            out = torch.cat(outs, dim=1)
        else:
            out = self._attend((q, k, v), batch, cast(Rotation, rope), cache).transpose(1, 2).reshape(b, t, -1)
        return self.all_reduce(self.o_proj(out * torch.sigmoid(gate.reshape(b, t, -1))))


SLOTS_A_STREAM = 2
"""A stream's slots in a layer's pool: the state its last step read and the one it wrote (the module docstring)."""


class StreamStates:
    """One linear layer's per-stream states: conv windows [slots, channels, kernel - 1] in the model's dtype and
    recurrent matrices [slots, v_heads, k_dim, v_dim] in float32, in pools that grow by doubling. `versions`
    maps a stream (its first KV block) to its (position, slot) pairs: the state it read last step and the one it
    wrote, at most two (see the module docstring)."""

    def __init__(self, conv: tuple[int, int], recurrent: tuple[int, int, int]) -> None:
        self.conv_shape, self.recurrent_shape = conv, recurrent
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None
        self.free: list[int] = []
        self.versions: dict[int, list[tuple[int, int]]] = {}

    def stream_bytes(self, dtype: torch.dtype) -> int:
        """What one stream holds here at most: SLOTS_A_STREAM slots of its conv window in `dtype` and its recurrent
        matrices in float32 (memory_math.torch_state_bytes counts the same for placement)."""
        conv = self.conv_shape[0] * self.conv_shape[1] * dtype.itemsize
        recurrent = self.recurrent_shape[0] * self.recurrent_shape[1] * self.recurrent_shape[2] * 4
        return SLOTS_A_STREAM * (conv + recurrent)

    def _grow(self, dtype: torch.dtype, device: torch.device) -> None:
        have = 0 if self.conv is None else self.conv.shape[0]
        more = max(2, have)
        conv = torch.zeros((more, *self.conv_shape), dtype=dtype, device=device)
        recurrent = torch.zeros((more, *self.recurrent_shape), dtype=torch.float32, device=device)
        self.conv = conv if self.conv is None else torch.cat((self.conv, conv))
        self.recurrent = recurrent if self.recurrent is None else torch.cat((self.recurrent, recurrent))
        self.free += range(have + more - 1, have - 1, -1)

    def _slot(self, dtype: torch.dtype, device: torch.device) -> int:
        if not self.free:
            self._grow(dtype, device)
        return self.free.pop()

    def step(self, keys: list[int], starts: list[int], length: int, dtype: torch.dtype,
             device: torch.device) -> tuple[list[int | None], list[int]]:
        """Per row (stream `keys[r]`, computing positions starts[r] .. + length): the slot holding its state at
        starts[r] (None: zeros, a stream starting over) and a fresh slot for its state after the step."""
        sources: list[int | None] = []
        dests: list[int] = []
        for key, start in zip(keys, starts, strict=True):
            held = self.versions.get(key, [])
            base = next((v for v in held if v[0] == start), None) if start else None
            if start and base is None:
                raise RuntimeError(f"no linear-attention state at position {start} for the stream in block {key} "
                                   f"(held: {[p for p, _ in held]})")
            self.free += [v[1] for v in held if v is not base]
            dest = self._slot(dtype, device)
            self.versions[key] = [*([base] if base is not None else []), (start + length, dest)]
            sources.append(None if base is None else base[1])
            dests.append(dest)
        return sources, dests

    def read(self, sources: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' states ([rows, ...] each), zeros where a row starts over."""
        assert self.conv is not None and self.recurrent is not None
        index = torch.tensor([s if s is not None else 0 for s in sources], device=self.conv.device)
        conv, recurrent = self.conv[index], self.recurrent[index]
        fresh = [r for r, s in enumerate(sources) if s is None]
        if fresh:
            conv[fresh], recurrent[fresh] = 0, 0
        return conv, recurrent

    def write(self, dests: list[int], conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        assert self.conv is not None and self.recurrent is not None
        index = torch.tensor(dests, device=self.conv.device)
        self.conv[index] = conv.to(self.conv.dtype)
        self.recurrent[index] = recurrent

    def forget(self, key: int) -> None:
        """The stream whose first block is `key` has left: its slots go back to the pool."""
        self.free += [slot for _, slot in self.versions.pop(key, [])]

    @property
    def streams(self) -> int:
        return len(self.versions)


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated: normalise in float32, scale by weight in the input dtype, times
    SiLU(gate) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class Conv(nn.Module):
    """linear_attn.conv1d: a depthwise kernel [channels, 1, kernel] (no bias), as nn.Conv1d stores it. Its channels
    are q's, k's and v's side by side: a tensor-parallel rank holds its heads' rows of each (tp_parts, the whole
    parts' sizes, which the loader splits one by one)."""

    def __init__(self, parts: tuple[int, int, int], kernel: int, tp_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(sum(parts) // tp_size, 1, kernel))
        self.tp_parts = {"weight": parts}

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """SiLU(conv) of x [B, channels, T] after the state [B, channels, kernel - 1]; and the new state."""
        full = torch.cat((state.to(self.weight.dtype), x.to(self.weight.dtype)), dim=-1)
        out = F.conv1d(full, self.weight, groups=full.shape[1])
        return F.silu(out).to(x.dtype), full[..., full.shape[-1] - state.shape[-1]:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (a decode step): q, k [B, H, T, dk] (normalised, q scaled), v [B, H, T,
    dv], g, beta [B, H, T], state [B, H, dk, dv], all float32; returns the outputs [B, H, T, dv] and the state.
    transformers' torch_recurrent_gated_delta_rule."""
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        state = state * g[:, :, i].exp()[..., None, None]
        memory = (state * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - memory) * beta[:, :, i].unsqueeze(-1)
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out, state


def chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a prompt chunk, CHUNK positions at a time (recurrent_rule's arguments and
    results): transformers' torch_chunk_gated_delta_rule, op for op."""
    b, h, t, _ = k.shape
    pad = (CHUNK - t % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, -1, CHUNK).cumsum(dim=3)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (g.unsqueeze(4) - g.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.zeros_like(values)
    for i in range(values.shape[2]):
        v_new = values[:, :, i] - k_decay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, -1, out.shape[-1])[:, :, :t], state


_LAST: list[tuple[StepBatch, tuple[list[int], list[int]]] | None] = [None]
"""The last batch part _streams read, with its rows' streams (one tuple, replaced whole: ranks run as threads in
tests), compared by identity: one read per part and step."""


def _streams(batch: StepBatch) -> tuple[list[int], list[int]]:
    """Each row's stream (its first KV block) and first position: read once per batch part, not once per linear
    layer (a device sync each on a GPU)."""
    memo = _LAST[0]
    if memo is None or memo[0] is not batch:
        memo = (batch, (batch.tables[:, 0].tolist(), batch.positions[:, 0].tolist()))
        _LAST[0] = memo
    return memo[1]


class GatedDeltaNet(nn.Module):
    """linear_attn: see the module docstring. Its states live in `states` (StreamStates), not in the KV cache.
    Tensor parallel: a rank holds num_k_heads / tp_size key heads and their value heads (the projections' rows
    come grouped by key head), and all-reduces out_proj's partial sum."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        shape = _shape(args)
        if shape.num_k_heads % tp_size or shape.num_v_heads % tp_size:
            raise ValueError(f"linear-attention heads ({shape.num_k_heads} key, {shape.num_v_heads} value) do not "
                             f"split evenly across {tp_size} tensor-parallel ranks")
        self.dk, self.dv = shape.head_k_dim, shape.head_v_dim
        self.nk, self.nv = shape.num_k_heads // tp_size, shape.num_v_heads // tp_size
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        channels = 2 * self.key_dim + self.value_dim
        whole = (shape.num_k_heads * self.dk, shape.num_k_heads * self.dk, shape.num_v_heads * self.dv)
        self._projections(args.hidden_size, whole)
        self.conv1d = Conv(whole, shape.conv_kernel, tp_size)
        self.dt_bias = nn.Parameter(torch.empty(self.nv))
        self.A_log = nn.Parameter(torch.empty(self.nv))
        self.norm = GatedRMSNorm(self.dv, args.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, args.hidden_size, bias=False)
        self.all_reduce = all_reduce
        self.states = StreamStates((channels, shape.conv_kernel - 1), (self.nv, self.dk, self.dv))

    def _projections(self, hidden: int, whole: tuple[int, int, int]) -> None:
        """Qwen3-Next's two input projections, each grouped by key head (_split); Qwen3.5 has four (qwen3_5.py).
        whole: the q, k and v channels' sizes over every rank."""
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * self.nv, bias=False)

    def forget_stream(self, key: int) -> None:
        self.states.forget(key)

    def state_bytes_per_stream(self, dtype: torch.dtype) -> int:
        return self.states.stream_bytes(dtype)

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch) -> torch.Tensor:
        """x [B, T, hidden]; a MixedBatch's parts (one sequence of rows) each on its own streams, in order."""
        if isinstance(batch, StepBatch):
            return self._part(x, batch)
        outs, at = [], 0
        for part, size in zip(batch.parts, batch.sizes, strict=True):
            rows, n = part.positions.shape
            outs.append(self._part(x[0, at : at + size].reshape(rows, n, -1), part).reshape(1, size, -1))
            at += size
        return torch.cat(outs, dim=1)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v flat side by side as the conv takes them [B, T, channels], z [B, T, v_heads, dv], b, a [B, T,
        v_heads]) from the projections' per-key-head groups (transformers' fix_query_key_value_ordering)."""
        b, t, _ = x.shape
        ratio = self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(b, t, self.nk, -1)
        q, k, v, z = qkvz.split([self.dk, self.dk, ratio * self.dv, ratio * self.dv], dim=3)
        beta, a = self.in_proj_ba(x).view(b, t, self.nk, -1).split([ratio, ratio], dim=3)
        mixed = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1)
        return mixed, z.reshape(b, t, -1, self.dv), beta.reshape(b, t, -1), a.reshape(b, t, -1)

    def _part(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        rows, t, _ = x.shape
        keys, starts = _streams(batch)
        sources, dests = self.states.step(keys, starts, t, x.dtype, x.device)
        conv_state, state = self.states.read(sources)
        mixed, z, b, a = self._split(x)
        mixed, conv_state = self.conv1d(mixed.transpose(1, 2), conv_state)
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        ratio = self.nv // self.nk
        q = q.reshape(rows, t, -1, self.dk).repeat_interleave(ratio, dim=2)
        k = k.reshape(rows, t, -1, self.dk).repeat_interleave(ratio, dim=2)
        v = v.reshape(rows, t, -1, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        q, k, v, beta, g = (y.transpose(1, 2).float().contiguous() for y in (q, k, v, beta, g))
        q, k = l2norm(q) * self.dk**-0.5, l2norm(k)
        rule = recurrent_rule if t == 1 else chunk_rule
        out, state = rule(q, k, v, g, beta, state)
        self.states.write(dests, conv_state, state)
        out = self.norm(out.transpose(1, 2).to(x.dtype), z)
        return self.all_reduce(self.out_proj(out.reshape(rows, t, -1)))


class SharedExpertMoe(SparseMoe):
    """SparseMoe's routed experts (softmax router, top k, renormalised) plus mlp.shared_expert, a SwiGLU every
    token runs, weighted by sigmoid(mlp.shared_expert_gate(x)) (transformers' Qwen3NextSparseMoeBlock)."""

    def __init__(self, args: ModelArgs, tp_size: int, all_reduce: AllReduce) -> None:
        super().__init__(args, tp_size, all_reduce)
        self.shared_expert = Expert(args.hidden_size, _shape(args).shared_expert_intermediate_size // tp_size)
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = self.mix(flat, *self.route(flat))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return self.all_reduce((routed + shared).view(x.shape))


class Qwen3NextLayer(nn.Module):
    """Pre-norm token mixer (linear_attn or self_attn) then MLP, each added to the residual; norms by 1 + weight."""

    sliding = False  # ModelSlice hands every layer the full-attention batch and rope
    delta_net: type[GatedDeltaNet] = GatedDeltaNet
    """The linear layers' token mixer (Qwen3.5's projects differently: qwen3_5.py)."""

    def __init__(self, args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)
        linear = index in _shape(args).linear_layers
        self.linear_attn = self.delta_net(args, tp_size, reduce) if linear else None
        self.self_attn = GatedAttention(args, tp_size, reduce) if self.linear_attn is None else None
        self.mlp = SharedExpertMoe(args, tp_size, reduce) if index in args.sparse_layers else MLP(args, tp_size, reduce)

    @property
    def holds_kv(self) -> bool:
        """A linear layer's past is its StreamStates: the slice gives it an empty KV pool (ModelSlice._stateful)."""
        return self.linear_attn is None

    def forward(self, x: torch.Tensor, batch: StepBatch | MixedBatch, rope: Rotation | tuple[Rotation, ...],
                cache: LayerCache) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if self.linear_attn is not None:
            mixed = self.linear_attn(normed, batch)
        else:
            assert self.self_attn is not None
            mixed = self.self_attn(normed, batch, rope, cache)
        h, normed = add_norm(x, mixed, self.post_attention_layernorm)
        return h + self.mlp(normed)


def layer(args: ModelArgs, index: int, tp_size: int, reduce: AllReduce) -> nn.Module:
    return Qwen3NextLayer(args, index, tp_size, reduce)


FAMILY = Family(("qwen3_next",), layer, fields, norm_unit_offset=True, stateful=True)
