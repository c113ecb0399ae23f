"""A Pipeline split balanced by decode work: what each rank reads per decode step, over its node's speed.

Decode reads every weight once per step, so a rank's step follows the bytes it holds: its layers' bytes, and on
the last rank the lm_head's (tied or not: the head is read there whatever tensor holds it) and the final norm's.
Rank 0's embedding is a gather of a few rows, memory but not work. With micro-batches in flight the busiest rank
sets the round (engines/micro_batching.py), so splitting layers equally leaves the last rank the slowest by the
head: SmolLM2's head is 30 MB against 2.2 MB a layer, 14 layers' worth.

Placement (shard_plan.plan_ring) starts from the memory-proportional split (the seed runbook's rule and its 400
arithmetic) and moves layers toward balanced_layers only as far as every rank still fits, weighing each node by
its measured speed where every node of the ring has one, else by what it holds (a large node is not taken for a
slow one on no evidence); the speed prediction (master/speed.py) weighs the ranks' parts with rank_work.
Integer arithmetic on rounded inputs, ties to the lower rank, so every node computes the same split.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from skulk.models.cards import _FLOAT_BYTES, _QUANT_BYTES  # the card estimates' bytes per weight
from skulk.types.models import ModelCard

SPEED_STEPS = 20
"""Node speeds are compared in steps of 1/SPEED_STEPS of the fastest's (5 %): a learned figure's jitter does not
move a layer between a preview and the placement that follows it."""


@dataclass(frozen=True)
class DecodeBytes:
    """What a decode step reads: each layer's bytes, and the head's (lm_head and final norm) on the last rank."""

    layer: int
    head: int


def _weight_bytes(card: ModelCard) -> float:
    """Bytes per weight of a card without measured figures: its dtype's, its bits' (a quantized checkpoint, with a
    scale and bias per group of 64), or the at-load format's."""
    if card.quantize_at_load is not None:
        return _QUANT_BYTES[card.quantize_at_load]
    if card.quantization == "none":
        return _FLOAT_BYTES[card.dtype]
    digits = re.match(r"\d+", card.quantization)  # "4", "4bit"
    bits = int(digits.group()) if digits else 8
    return bits / 8 + 4 / 64


def decode_bytes(card: ModelCard) -> DecodeBytes:
    """The card's measured figures (layer_bytes, head_bytes: an import that read the tensors), else an estimate:
    the head is vocab x hidden at the card's bytes per weight and the layers hold the rest of storage_size, as
    though the embedding were tied (an untied model's layers then look one embedding heavier, which only moves
    fewer layers off the last rank). No vocabulary, no head: the split stays the memory one."""
    if card.layer_bytes is not None and card.head_bytes is not None:
        return DecodeBytes(max(1, card.layer_bytes // max(1, card.n_layers)), card.head_bytes)
    storage = card.storage_size.in_bytes
    if not card.vocab_size or card.embeds:
        return DecodeBytes(max(1, storage // max(1, card.n_layers)), 0)
    table = card.vocab_size * card.hidden_size
    head = int(table * _weight_bytes(card))
    embedding = int(table * _FLOAT_BYTES[card.dtype]) if card.quantize_at_load is not None else 0
    layers = storage - head - embedding  # at load: a float embedding beside the head's quantized copy
    if layers <= 0:
        return DecodeBytes(max(1, storage // max(1, card.n_layers)), 0)
    return DecodeBytes(max(1, layers // max(1, card.n_layers)), head)


def rank_work(work: DecodeBytes, counts: Sequence[int]) -> list[int]:
    """Bytes each rank reads per decode step holding counts[i] layers (rank order): the last adds the head."""
    return [n * work.layer + (work.head if i == len(counts) - 1 else 0) for i, n in enumerate(counts)]


def speed_costs(step_s_per_gb: Sequence[float | None]) -> list[int] | None:
    """Each node's cost per byte in SPEED_STEPS-ths of the fastest's (20: as fast as the fastest, 40: half as
    fast); None unless every node has a positive figure (then the split assumes equal speeds)."""
    if not step_s_per_gb or any(s is None or s <= 0 for s in step_s_per_gb):
        return None
    fastest = min(s for s in step_s_per_gb if s is not None)
    return [max(SPEED_STEPS, round(SPEED_STEPS * s / fastest)) for s in step_s_per_gb if s is not None]


def memory_costs(capacity: Sequence[int]) -> list[int]:
    """Costs per byte for nodes whose speeds are unknown: inversely as what each can hold (the memory split's
    weights), so with no head the balanced split is the memory split and a large node is not taken for a slow one
    (equal memory: equal speeds)."""
    largest = max(max(capacity, default=1), 1)
    return [max(SPEED_STEPS, round(SPEED_STEPS * largest / max(c, 1))) for c in capacity]


def balanced_layers(n_layers: int, work: DecodeBytes, costs: Sequence[int]) -> list[int]:
    """Layers per rank that minimise the slowest rank's step (its bytes times its node's cost), every rank at
    least one: each layer in turn goes to the rank that would be done soonest holding it (ties to the lower rank),
    which is optimal for steps that grow with each layer added."""
    count = len(costs)
    if count == 0 or n_layers < count:
        raise ValueError(f"cannot give {count} ranks at least one of {n_layers} layers")
    layers = [1] * count

    def step_with_one_more(i: int) -> int:
        return ((layers[i] + 1) * work.layer + (work.head if i == count - 1 else 0)) * costs[i]

    for _ in range(n_layers - count):
        layers[min(range(count), key=lambda i: (step_with_one_more(i), i))] += 1
    return layers


def steps_toward(start: Sequence[int], goal: Sequence[int]) -> Iterator[list[int]]:
    """The splits from start to goal (same ranks, same total), one layer moved at a time: from the rank most over
    its goal to the rank most under it (ties to the lower rank), so each split is nearer the goal than the one
    before."""
    layers = list(start)
    while layers != list(goal):
        over = max(range(len(layers)), key=lambda i: (layers[i] - goal[i], -i))
        under = max(range(len(layers)), key=lambda i: (goal[i] - layers[i], -i))
        layers[over] -= 1
        layers[under] += 1
        yield list(layers)
