"""Rank 0's decisions for one engine step, as pure functions of the slot state.

Three questions are answered here and nowhere else: what kind of step runs next (a prefill chunk, a decode of
every running request, or both in one forward pass while both are wanted, so running streams keep flowing
during a long prefill), how many prompt tokens that chunk takes, and which retained prefix (the KV of a request that has
left, still sitting in a free cache slot) a new request can start from. The engine applies the answers; the
other ranks receive them in the step header, so nothing here needs to run anywhere but rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .wire import MAX_ADMITS, StepKind

MIN_CHUNK = 4
"""The smallest chunk riding on running streams' decode step. Below MIXED_STACK_ROWS a chunk token costs about the
same from 1 token up (model.py), so the floor only bounds the steps a prompt takes; at 16 the floor itself put the
streams' gap at 4-6 decode steps on the 100M f32 model (bench/scheduling.py)."""
CHUNK_STEPS = 0.8
"""A chunk riding on a decode step is sized to add this many decode steps to it: the streams' gap is ~1.8 steps,
with room for the chunk's cost growing with the context until it is measured again (at 1.0 the largest gap was
2.8-3.1 steps)."""


@dataclass(frozen=True, slots=True)
class Retained:
    """The KV of a request that has left, kept in the free slot `slot` for positions [0, length).

    tokens are the ids those positions hold; only the scheduler knows them (it sees every sampled token), so
    on other ranks they are empty and the header names the slot and length to reuse.
    """

    slot: int
    length: int
    stamp: int  # larger is more recent: the least recent is the first to be overwritten
    tokens: tuple[int, ...] = ()


def next_kind(*, prefilling: bool, decoding: bool) -> StepKind:
    """A prompt beside running streams is prefilled in chunks that ride on their decode steps (MIXED: one
    forward pass over both reads the weights once, and no stream waits for a separate chunk step); a prompt
    alone goes in PREFILL chunks. prefilling counts the requests this step's header admits."""
    if prefilling and decoding:
        return StepKind.MIXED
    if prefilling:
        return StepKind.PREFILL
    return StepKind.DECODE if decoding else StepKind.HEARTBEAT


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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def choose_reuse(retained: Iterable[Retained], prompt: Sequence[int]) -> tuple[int, int]:
    """(slot, length) of the retained prefix sharing the most leading tokens with prompt, or (-1, 0).

    At least the prompt's last token is always computed: its logits give the first generated token.
    """
    best_slot, best_len = -1, 0
    for entry in retained:
        shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1, entry.length)
        if shared > best_len:
            best_slot, best_len = entry.slot, shared
    return best_slot, best_len


def spare_slot(retained: dict[int, Retained], first_free: int, max_slots: int, keep: set[int]) -> int | None:
    """A free slot to park a retained prefix in: one holding nothing, else the least recent entry's (never one
    in keep); None when every free slot is kept."""
    candidates = [s for s in range(first_free, max_slots) if s not in keep]
    empty = [s for s in candidates if s not in retained]
    if empty:
        return empty[-1]
    if not candidates:
        return None
    return min(candidates, key=lambda s: retained[s].stamp)
