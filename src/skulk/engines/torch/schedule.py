"""Rank 0's decisions for one engine step, as pure functions of the slot state.

Answered here and nowhere else: what kind of step runs next (a prefill chunk, a decode of every running request,
or both in one forward pass while both are wanted, so running streams keep flowing during a long prefill), how
many prompt tokens that chunk takes, how many KV blocks admissions and growth take, and how large the block pool
is. The engine applies the answers; the other ranks receive them in the step header, so nothing here needs to
run anywhere but rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from skulk import memory_limit
from skulk.engines.kv_pools import DEFAULT_KV_FRACTION

from .blocks import blocks_for
from .header import MAX_ADMITS, StepKind

MIN_CHUNK = 4
"""The smallest chunk riding on running streams' decode step. Below MIXED_STACK_ROWS a chunk token costs about the
same from 1 token up (model.py), so the floor only bounds the steps a prompt takes; at 16 the floor itself put the
streams' gap at 4-6 decode steps on the 100M f32 model (bench/scheduling.py)."""
CHUNK_STEPS = 0.8
"""A chunk riding on a decode step is sized to add this many decode steps to it: the streams' gap is ~1.8 steps,
with room for the chunk's cost growing with the context until it is measured again (at 1.0 the largest gap was
2.8-3.1 steps)."""


def next_kind(*, prefilling: bool, decoding: bool) -> StepKind:
    """A prompt beside running streams is prefilled in chunks that ride on their decode steps (MIXED: one
    forward pass over both reads the weights once, and no stream waits for a separate chunk step); a prompt
    alone goes in PREFILL chunks. prefilling counts the requests this step's header admits."""
    if prefilling and decoding:
        return StepKind.MIXED
    if prefilling:
        return StepKind.PREFILL
    return StepKind.DECODE if decoding else StepKind.HEARTBEAT


def micro_batch(busy: Sequence[bool], decoding: Sequence[bool], ranks: int) -> tuple[int, int] | None:
    """The running rows [start, end) a Pipeline's next step decodes while earlier micro-batches are still in flight.

    busy[i]: row i's last step is still on its way through the ranks (its next input token is not back yet);
    decoding[i]: row i is past its prompt. The micro-batch is the first run of rows that are not busy, from the
    first idle decoding row, holding at most a 1/ranks share of all decoding rows (so `ranks` micro-batches keep
    every rank busy) and ending on a decoding row. None: no decoding row is idle. With nothing busy and one rank,
    that is every decoding row, the unpipelined schedule."""
    share = -(-sum(decoding) // max(1, ranks))
    start = next((i for i, (b, d) in enumerate(zip(busy, decoding, strict=True)) if d and not b), None)
    if start is None:
        return None
    end, taken = start, 0
    for i in range(start, len(busy)):
        if busy[i] or taken == share:
            break
        if decoding[i]:
            taken, end = taken + 1, i + 1
    return start, end


def share_chunk(rests: Sequence[int], chunk: int) -> list[int]:
    """Tokens each prompt being prefilled computes this step, given what is left of each (in slot order): the
    chunk goes to the first until its prompt is done, then to the next, so several short prompts share one step
    and a long one is never starved by later arrivals. At least one token in all: every prefill step progresses."""
    shares, left = [], max(1, chunk)
    for rest in rests:
        take = min(rest, left)
        shares.append(take)
        left -= take
    return shares


def can_admit(*, rests: Sequence[int], chunk: int, free_slots: int, admitted: int) -> bool:
    """Whether one more pending request joins this step: a slot is free, the header has room, and the chunk
    outlasts the prompts already being prefilled (so it computes at least the newcomer's first tokens)."""
    return free_slots > 0 and admitted < MAX_ADMITS and sum(rests) < max(1, chunk)


def chunk_tokens(
    max_chunk: int, *, decoding: bool, decode_s: float, last_chunk: tuple[int, float] | None
) -> int:
    """How many prompt tokens the next prefill chunk takes.

    Alone, a prompt goes in chunks of max_chunk (which bounds the attention scores' memory). Riding on running
    streams' decode step, a chunk should add CHUNK_STEPS of their decode steps to it, so their gap between
    tokens stays under two steps. A chunk's cost is not proportional to its tokens (attention grows with the
    context), so the size is steered by the last chunk's measured (tokens, seconds it added) and at most
    doubles from one step to the next; with nothing measured it starts at the floor.
    """
    if not decoding:
        return max_chunk
    floor = min(MIN_CHUNK, max_chunk)
    if decode_s <= 0 or last_chunk is None:
        return floor
    tokens, added = last_chunk
    fitted = int(tokens * CHUNK_STEPS * decode_s / added) if added > 0 else 2 * tokens
    return max(floor, min(max_chunk, 2 * tokens, fitted))


class _Holder(Protocol):
    length: int
    table: list[int]


def growth_blocks(running: Iterable[_Holder], block_size: int) -> int:
    """Blocks the running requests must take before the next step: each needs one for its next position."""
    return sum(max(0, blocks_for(r.length + 1, block_size) - len(r.table)) for r in running)


def admission_blocks(prompt_tokens: int, shared: int, block_size: int) -> int:
    """Fresh blocks a request admitted with `shared` cached blocks takes: its whole prompt and its first decode."""
    return blocks_for(prompt_tokens + 1, block_size) - shared


def pool_blocks(kv_bytes: int | None, per_token: int, block_size: int, context: int, streams: int,
                available: int | None = None) -> int:
    """The block pool's size: kv_bytes' worth (a placement's kv_cache_gb), or by default DEFAULT_KV_FRACTION of the
    memory available now, but never more than `streams` requests of the whole context; never fewer blocks than
    one request of the whole context needs, so any admitted prompt can run (alone, if it must)."""
    block_bytes = max(1, per_token * block_size)
    least = blocks_for(context + 1, block_size)
    if kv_bytes is None:
        free = memory_limit.available_now() if available is None else available
        kv_bytes = min(int(free * DEFAULT_KV_FRACTION), per_token * context * streams)
    return max(least, kv_bytes // block_bytes)
