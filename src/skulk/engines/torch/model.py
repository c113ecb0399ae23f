"""A decoder of any native family (models/: Llama, Qwen, Mistral, Gemma 3, Qwen3-MoE) owning layers
[start_layer, end_layer) and one tensor-parallel shard.

The first slice embeds token ids, inner slices map hidden states to hidden states, the last slice applies the
final norm and lm_head; a slice holding every layer is the whole model. A pipeline stage therefore runs
`forward(hidden_or_ids, batch, cache)` on its own slice and ships the result to the next stage. Parameters are
created on the meta device and filled in by loader.load_model, so building a slice never allocates weights
it does not own.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from . import cpu_kernels
from .cache import KVCache, MixedBatch, StepBatch
from .config import ModelArgs
from .layers import AllReduce, DecoderLayer, RMSNorm, Rope, identity, softcap_logits
from .matmul import Linear
from .models import family_of, make_layer

_COLUMN_SPLIT = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj|in_proj_qkvz|in_proj_ba"
                           r"|in_proj_z|in_proj_b|in_proj_a)\.(weight|bias)$|\.linear_attn\.(A_log|dt_bias)$")
"""Split by output rows (heads, MLP width); Qwen3-Next's linear attention by key-head groups (in_proj_qkvz and
in_proj_ba hold each key head's q, k, v, z and b, a side by side) and value heads (A_log, dt_bias; Qwen3.5's
in_proj_z, in_proj_b, in_proj_a; its in_proj_qkv splits part by part, as the conv: loader._tp_parts)."""
_ROW_SPLIT = re.compile(r"\.(o_proj|down_proj|out_proj)\.weight$")
_GPT_OSS_SPLIT = {"self_attn.sinks": 0, "mlp.experts.gate_up_proj": 2, "mlp.experts.gate_up_proj_bias": 1,
                  "mlp.experts.down_proj": 1}
"""gpt-oss's per-head sinks, and its stacked experts ([experts, hidden, 2 x width] with gate and up interleaved
column by column, [experts, width, hidden]): each rank holds its heads' sinks and a block of every expert's width
(a block of interleaved columns is whole gate/up pairs)."""
_GPT_OSS = re.compile(r"\.(self_attn\.sinks|mlp\.experts\.(?:gate_up_proj|gate_up_proj_bias|down_proj))$")
_ROW_SPLIT_BIAS = re.compile(r"\.(o_proj\.bias|down_proj\.bias|experts\.down_proj_bias)$")
_PARTIAL_SUM = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj|linear_attn\.out_proj)$")
"""Row-split projections whose per-rank partial sums the all_reduce adds in float32 (a MoE's experts add theirs
into one buffer in the activations' dtype)."""

MIXED_STACK_ROWS = 64
"""A mixed step of fewer rows runs through the one-call layer stack (ModelSlice._mixed_stack). Measured on the
2-core EPYC (100M bench model, 4 decode rows at 1,000 positions and a chunk, 2 threads): the stack adds 1.1-2.4 ms
per chunk token flat from 1 to 64 tokens (int4, bf16, f32), while the per-layer path jumps at 16 rows to 3-8 ms a
token (bf16: 133 ms a step against 54; int4: 60 against 24), so a chunk riding on a decode step stays cheap
enough to keep the streams' gap under 3 steps."""


def tp_split_dim(param_name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks; None when it is replicated."""
    if _COLUMN_SPLIT.search(param_name):
        return 0
    if _ROW_SPLIT.search(param_name):
        return 1
    if match := _GPT_OSS.search(param_name):
        return _GPT_OSS_SPLIT[match.group(1)]
    return None


def partial_sum_bias(param_name: str) -> bool:
    """The bias of a row-split projection: each tensor-parallel rank's output is a partial sum, so only rank 0
    adds the bias (the loader gives the others zeros) and the all_reduce adds it once."""
    return bool(_ROW_SPLIT_BIAS.search(param_name))


@runtime_checkable
class HoldsStreamStates(Protocol):
    """A token mixer keeping per-stream states outside the KV cache (Qwen3-Next's GatedDeltaNet)."""

    def state_bytes_per_stream(self, dtype: torch.dtype) -> int: ...


class ModelSlice(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        end = args.num_hidden_layers if end_layer is None else end_layer
        _check_partition(args, start_layer, end, tp_rank, tp_size)
        self.args, self.start_layer, self.end_layer = args, start_layer, end
        self.family = family_of(args)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.is_first, self.is_last = start_layer == 0, end == args.num_hidden_layers
        reduce = _rounded(all_reduce, args.dtype) if all_reduce is not None and tp_size > 1 else identity
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size) if self.is_first else None
            self.layers = nn.ModuleDict(
                {str(i): make_layer(args, i, tp_size, reduce) for i in range(start_layer, end)}
            )
            unit_offset = self.family.norm_unit_offset
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset) if self.is_last else None
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False) if self.is_last else None
        if self.lm_head is not None:
            self.lm_head.out_dtype = torch.float32  # logits unrounded: bf16's steps (0.125 near 20) made exact ties
        if tp_size > 1:
            for name, module in self.named_modules():
                if _PARTIAL_SUM.search(name) and isinstance(module, Linear):
                    module.out_dtype = torch.float32
        self.rope = Rope(args, device)
        local_layers = any(args.is_sliding(i) for i in range(start_layer, end))
        self.windowed = local_layers and args.sliding_window is not None
        self.local_rope = Rope(args, device, local=True) if local_layers and args.rope_local_theta else None
        self._stack: tuple[weakref.ref[KVCache], torch.dtype, cpu_kernels.LayerStack | None] | None = None

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads this shard holds: the cache is sized by it (MLA's one latent: whole on every rank)."""
        return self.args.num_key_value_heads // (1 if self.args.mla else self.tp_size)

    @property
    def value_dim(self) -> int | None:
        """The cached values' width where it is not head_dim: none at all for MLA, whose latent is its key's first
        kv_lora_rank columns (models/deepseek_v3.py)."""
        return 0 if self.args.mla else None

    def make_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                   local_blocks: int | None = None, bits: int = 16) -> KVCache:
        """A paged cache of num_blocks blocks for this slice's layers and shard's heads; local_blocks: a hybrid
        model's sliding layers get their own pools of that many blocks (None: one pool size for every layer, read
        through one block table); bits: 16 keeps keys and values in the model's dtype, 8 or 4 quantizes them."""
        local = self._sliding() if local_blocks is not None else self._stateful()
        return KVCache(
            len(self.layers), num_blocks, self.n_kv_heads, block_size, self.args.head_dim,
            dtype=dtype or self.args.dtype, device=self.rope.inv_freq.device, local=local,
            local_blocks=local_blocks or 0, bits=bits, value_dim=self.value_dim,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None, bits: int = 16) -> int:
        """What one position of one request costs in this slice's cache at `bits`: its layers that hold KV only. At
        least 1: a slice of state-only layers (Qwen3-Next's linear ones) then sizes its pool by the streams'
        ceiling (schedule.pool_blocks), not by the least one whole-context request needs, which would become
        the whole group's pool (the group takes its smallest)."""
        return max(1, KVCache.bytes_per_token(len(self.layers) - sum(self._stateful()), self.n_kv_heads,
                                              self.args.head_dim, dtype or self.args.dtype, bits, self.value_dim))

    def state_bytes_per_stream(self) -> int:
        """What one stream's per-stream states cost this slice at most (Qwen3-Next's linear layers:
        state_bytes_per_stream on their token mixer); 0 for a slice of KV layers only. The pool budget leaves
        room for them (core.pool_sizes)."""
        return sum(module.state_bytes_per_stream(self.args.dtype) for module in self.modules()
                   if module is not self and isinstance(module, HoldsStreamStates))

    def group_bytes_per_token(self, dtype: torch.dtype | None = None, bits: int = 16) -> tuple[int, int]:
        """What one position costs in this slice's (full group, sliding group) pools of a hybrid model."""
        sliding = sum(self._sliding())
        per = [KVCache.bytes_per_token(n, self.n_kv_heads, self.args.head_dim, dtype or self.args.dtype, bits,
                                       self.value_dim) for n in (len(self.layers) - sliding, sliding)]
        return per[0], per[1]

    def _stateful(self) -> tuple[bool, ...]:
        """Per owned layer, whether it keeps a per-stream state instead of KV rows (Qwen3-Next's linear attention:
        its layer's holds_kv is False), when any does: those layers' pools hold no block (a second KV group of 0
        blocks). Empty: every layer holds KV."""
        flags = tuple(not getattr(layer, "holds_kv", True) for layer in self.layers.values())
        return flags if any(flags) else ()

    def _sliding(self) -> tuple[bool, ...]:
        """Per owned layer, whether it attends through the sliding window."""
        return tuple(self.args.is_sliding(i) for i in range(self.start_layer, self.end_layer))

    def forward(
        self, x: torch.Tensor, batch: StepBatch | MixedBatch, cache: KVCache, *, last_only: bool = False
    ) -> torch.Tensor:
        """Run the slice: ids [B, T] (first slice) or hidden [B, T, H] in; hidden, or logits (last slice) out.

        last_only keeps only the final position before lm_head, which is all sampling needs after a prefill.
        A MixedBatch's tokens come as one sequence ([1, rows]); last_only then keeps each of its rows' final
        position (every row of a decode part, a chunk's last token), in order. Logits come back in float32, as
        the head's matmul accumulated them (lm_head.out_dtype: never rounded to the activations' dtype on the way),
        so near-equal candidates stay apart and every placement samples from the same numbers.
        """
        h = self.embed(x) if self.embed_tokens is not None and not x.is_floating_point() else x
        if isinstance(batch, StepBatch) and h.shape[1] == 1 and (stack := self._layer_stack(h, batch, cache)):
            h = stack(h, batch.positions, self.rope(batch.rope_positions, h.dtype), batch.tables)
        elif (isinstance(batch, MixedBatch) and h.shape[1] < MIXED_STACK_ROWS
              and not any(part.bidirectional for part in batch.parts)
              and (stack := self._layer_stack(h, batch.parts[0], cache))):
            h = self._mixed_stack(stack, h, batch)
        else:
            full, local = self._contexts(batch, h.dtype)
            for layer, layer_cache in zip(self.layers.values(), cache.layers, strict=True):
                h = layer(h, *(local if layer.sliding else full), layer_cache)
        if self.norm is None or self.lm_head is None:
            return h
        if last_only:
            h = h[:, _last_rows(batch)] if isinstance(batch, MixedBatch) else h[:, -1:]
        return softcap_logits(self.lm_head(self.norm(h)).float(), self.args)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The first slice's input embeddings (Gemma's scaled): a vision model's image rows are replaced in them
        before forward (step.py), which then takes them as hidden states."""
        assert self.embed_tokens is not None
        return self.family.scale_embeddings(self.embed_tokens(ids), self.args)

    def _contexts(self, batch: StepBatch | MixedBatch, dtype: torch.dtype) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """(batch, rope) for full-attention layers and for sliding ones (the windowed batch, the local rope);
        a MixedBatch gets each part's, as a MixedBatch and a tuple of ropes."""
        if isinstance(batch, MixedBatch):
            pairs = [self._contexts(part, dtype) for part in batch.parts]
            return ((MixedBatch(tuple(p[0][0] for p in pairs)), tuple(p[0][1] for p in pairs)),
                    (MixedBatch(tuple(p[1][0] for p in pairs)), tuple(p[1][1] for p in pairs)))
        rope = self.rope(batch.rope_positions, dtype)
        local_rope = self.local_rope(batch.positions, dtype) if self.local_rope is not None else rope
        return (batch, rope), (self._windowed_batch(batch) if self.windowed else batch, local_rope)

    def _mixed_stack(self, stack: cpu_kernels.LayerStack, h: torch.Tensor, batch: MixedBatch) -> torch.Tensor:
        """A short mixed step through the layer stack: every token a row with its own position and block table (a
        chunk's tokens share their request's), so decode rows and a small prefill chunk (the last tokens of a
        prompt whose prefix was reused) take the decode step's one call instead of the per-layer path."""
        positions = torch.cat([part.positions.reshape(-1) for part in batch.parts]).view(-1, 1)
        width = max(part.tables.shape[1] for part in batch.parts)
        tables = torch.cat([torch.nn.functional.pad(part.tables, (0, width - part.tables.shape[1]))
                            .repeat_interleave(part.positions.shape[1], dim=0) for part in batch.parts])
        rows = positions.shape[0]
        out = stack(h.reshape(rows, 1, -1), positions, self.rope(_rope_rows(batch, positions), h.dtype), tables)
        return out.view(1, rows, -1)

    def _layer_stack(self, h: torch.Tensor, batch: StepBatch, cache: KVCache) -> cpu_kernels.LayerStack | None:
        """Every layer of a decode step in one kernel call, when each layer runs as one (layers.DecoderLayer.native)
        and they share one rope; built once per cache (held by a weak reference: the cache's owner frees it)."""
        memo = self._stack
        if memo is not None and memo[0]() is cache and memo[1] == h.dtype:
            return memo[2]
        stack = None
        if self.local_rope is None and batch.window == 0 and batch.local is None and cpu_kernels.handles(h):
            descs = [layer.native(h.dtype, c) if isinstance(layer, DecoderLayer) else None
                     for layer, c in zip(self.layers.values(), cache.layers, strict=True)]
            if all(d is not None for d in descs):
                windows = [(self.args.sliding_window or 0) if self.windowed and layer.sliding else 0
                           for layer in self.layers.values()]
                stack = cpu_kernels.LayerStack(descs, windows, [c.keys for c in cache.layers],  # type: ignore[arg-type]
                                               [c.values for c in cache.layers])
        self._stack = (weakref.ref(cache), h.dtype, stack)
        return stack

    def _windowed_batch(self, batch: StepBatch) -> StepBatch:
        """The step's batch with keys older than the sliding window masked too: a query at position p sees keys
        p - window + 1 .. p. Derived from positions, so a prefill chunk starting at any offset is right."""
        window = self.args.sliding_window or 0
        keys = torch.arange(batch.kv_len, device=batch.positions.device).view(1, 1, 1, -1)
        near = keys > batch.positions.unsqueeze(1).unsqueeze(-1) - window
        tables = batch.tables if batch.local is None else batch.local  # a hybrid model's sliding group's own
        return dataclasses.replace(batch, mask=near & batch.mask, window=window, tables=tables)


def _rope_rows(batch: MixedBatch, positions: torch.Tensor) -> torch.Tensor:
    """The rope positions of a mixed step's rows as _mixed_stack lays them out (one token a row): `positions`
    ([rows, 1]), or where a part has multimodal rope's, every part's as [3, rows, 1] (mrope.py)."""
    if all(part.rope is None for part in batch.parts):
        return positions
    rows = [part.rope.reshape(3, -1) if part.rope is not None else part.positions.reshape(1, -1).expand(3, -1)
            for part in batch.parts]
    return torch.cat(rows, dim=1).unsqueeze(-1)


def _last_rows(batch: MixedBatch) -> list[int]:
    """Where each row of each part ends in a MixedBatch's sequence."""
    ends, at = [], 0
    for part in batch.parts:
        rows, tokens = part.positions.shape
        ends += [at + (r + 1) * tokens - 1 for r in range(rows)]
        at += rows * tokens
    return ends


def _rounded(all_reduce: AllReduce, dtype: torch.dtype) -> AllReduce:
    """The all_reduce a tensor-parallel slice's layers call: it adds float32 partial sums (a part in another dtype,
    a MoE block's, is reduced as a float32 copy) and rounds the total to the activations' dtype once, so a split
    model rounds where the whole one does."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x.float()).to(dtype)  # o_proj/down_proj's parts come as float32 (no copy); a MoE's are cast

    return reduce


def _check_partition(args: ModelArgs, start: int, end: int, tp_rank: int, tp_size: int) -> None:
    if not 0 <= start < end <= args.num_hidden_layers:
        raise ValueError(f"layer slice [{start}, {end}) is not inside [0, {args.num_hidden_layers})")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    for what, n in (
        ("attention heads", args.num_attention_heads),
        ("key/value heads", 0 if args.mla else args.num_key_value_heads),  # MLA's latent: whole on every rank
        ("intermediate size", args.intermediate_size),
        ("expert intermediate size", args.moe_intermediate_size),
    ):
        if n % tp_size:
            raise ValueError(f"{what} ({n}) do not split evenly across {tp_size} tensor-parallel ranks")
