"""How a KV budget splits between the block pools of a hybrid model's two layer groups (torch-free: placement
sizes the same pools before a runner exists).

A model whose layers all attend alike (Llama, Qwen, Mistral: every layer full, or every layer through one window)
has one layer group, one block pool and one block table per request. Gemma 3 interleaves sliding-window layers
with global ones: its global layers need every position's block, its sliding layers only the blocks inside the
window, so each group gets its own pool and table (vLLM's hybrid KV cache manager does the same). The sliding
("local") pool then needs to hold only what requests can see through their windows at once, however long their
contexts grow: `local_pool_blocks`. This module is the one rule for both the engine (engines/torch/core.py) and
placement (master/shard_plan.py): the local pool holds min(full pool, local_pool_blocks) blocks, the rest of the
budget is the full pool's.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 32
"""Positions per KV block of the torch engine (placement sizes a hybrid model's local pool with it)."""
DEFAULT_KV_FRACTION = 0.25
"""With no kv_cache_gb (neither the placement's nor the card's), the share of the memory free after the weights
that the KV pool takes: placement sizes each rank's pool with it (the tightest node of the ring), and the torch
engine takes it of the memory available at load when built outside placement. The pool's pages are committed only
as blocks are first used, so a mostly idle pool costs little."""
DEFAULT_PREFILL_CHUNK = 512
"""Prompt tokens per prefill step of the torch engine (a local pool holds one chunk running ahead of its window)."""


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks a request needs to hold `positions` positions."""
    return -(-positions // block_size)


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a sliding group's request holds at a decode step: the `window` positions its next token sees
    straddle at most one block more than they fill."""
    return blocks_for(window, block_size) + 1


def local_pool_blocks(window: int, block_size: int, streams: int, chunk: int) -> int:
    """Blocks a local pool needs so it never limits `streams` requests: each at a decode step holds its window and
    may take one block for its next position, and one prefill chunk (whose tokens see a window each) runs ahead."""
    return streams * (window_blocks(window, block_size) + 1) + blocks_for(chunk, block_size) + 1


def local_least(window: int, block_size: int, chunk: int, context: int) -> int:
    """The fewest blocks a local pool may have: one request alone, prefilling a whole chunk past its window."""
    return min(blocks_for(context + 1, block_size), blocks_for(window + chunk, block_size) + 2)


def hybrid_window(window: int | None, sliding: Sequence[bool]) -> int:
    """The local group's window of a model whose layers slide as `sliding` says, or 0 when it has one layer group
    (no window, or every layer alike)."""
    return (window or 0) if any(sliding) and not all(sliding) else 0


def split_pool(kv_bytes: int, full_block: int, local_block: int, local_cap: int, most: int) -> tuple[int, int]:
    """(full blocks, local blocks) that kv_bytes buys, blocks costing full_block and local_block bytes each (this
    rank's layers of each group), the local pool holding min(full, local_cap) blocks; at most `most` full blocks
    (what a rank without global layers holds: they cost it nothing)."""
    both = full_block + local_block
    if both <= 0:
        return most, min(most, local_cap)
    if local_cap * both >= kv_bytes:
        n = min(most, kv_bytes // both)
        return n, n
    if full_block <= 0:
        return most, min(most, local_cap)
    return min(most, (kv_bytes - local_cap * local_block) // full_block), local_cap


def group_pools(kv_bytes: int, per_token: tuple[int, int], block_size: int, context: int, streams: int,
                window: int, chunk: int) -> tuple[int, int]:
    """A hybrid model's (full, local) pool blocks on a rank whose layers cost per_token = (full group, local group)
    bytes a position: kv_bytes split by split_pool, never fewer than one whole-context request needs (full) or one
    request prefilling a chunk past its window (local), never more than `streams` whole-context requests use."""
    least = blocks_for(context + 1, block_size)
    cap = local_pool_blocks(window, block_size, streams, chunk)
    full, local = split_pool(kv_bytes, per_token[0] * block_size, per_token[1] * block_size, cap, streams * least)
    return max(least, full), max(local_least(window, block_size, chunk, context), min(local, cap))


def group_pool_bytes(per_token: tuple[int, int], block_size: int, context: int, streams: int, window: int,
                     chunk: int) -> int:
    """What `streams` requests of the whole context can use at most in a hybrid model's two pools (the default
    pool's ceiling)."""
    least = blocks_for(context + 1, block_size)
    local = min(streams * least, local_pool_blocks(window, block_size, streams, chunk))
    return (per_token[0] * streams * least + per_token[1] * local) * block_size


KV_BITS = (16, 8, 4)
"""What a KV cache may be stored in: 16 (the model's own float dtype, unquantized; 4 bytes an element for a float32
model), 8 (int8, symmetric, one scale per position and head) or 4 (int4 packed two a byte, symmetric, one scale per
group of KV_GROUP elements of a position's head). llama.cpp's -ctk/-ctv q8_0/q4_0, vLLM's fp8 KV."""
KV_GROUP = 32
"""Elements of a head's key or value sharing one int4 scale (llama.cpp's q4_0 blocks are 32 too)."""
SCALE_BYTES = 2
"""A quantized cache's scales are float16."""


def int4_group(head_dim: int) -> int:
    """The int4 scale group for a head of head_dim elements: KV_GROUP where it divides head_dim, else the largest
    even divisor of head_dim at most KV_GROUP (a head of 80 gets groups of 20)."""
    return next(g for g in range(min(KV_GROUP, head_dim), 1, -1) if head_dim % g == 0 and g % 2 == 0)


def kv_head_bytes(head_dim: int, bits: int, float_bytes: int) -> int:
    """Bytes one position of one head's keys (or values) takes at `bits`: the model's floats at 16, else the
    quantized elements and their float16 scales. The one rule for the engine's pools and placement's sizing."""
    if bits == 16:
        return head_dim * float_bytes
    if bits == 8:
        return head_dim + SCALE_BYTES
    if bits == 4:
        return head_dim // 2 + SCALE_BYTES * (head_dim // int4_group(head_dim))
    raise ValueError(f"kv_cache_bits must be one of {KV_BITS}, not {bits}")
