"""A Pipeline split balanced by decode work (master/balance.py, shard_plan.plan_ring): the last rank's head counts,
a faster node takes more layers, and memory stays the rule wherever it binds."""

from __future__ import annotations

import pytest

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES
from skulk.master.balance import (
    DecodeBytes,
    balanced_layers,
    decode_bytes,
    memory_costs,
    rank_work,
    speed_costs,
    steps_toward,
)
from skulk.master.shard_plan import allocate_layers, plan_ring
from skulk.models.cards import get_card, with_quantization
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.links import DecodeCompute
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from skulk.types.state import State

from .test_placement import do_place, placed, state

pytestmark = pytest.mark.timeout(10)

RING = [NodeId("a"), NodeId("b")]
ROOMY = 64 << 30


def card(vocab: int | None, **overrides: object) -> ModelCard:
    """30 layers of 2 MB (bf16), with a vocab x 512 bf16 head beside them (tied)."""
    storage = 30 * 2_000_000 + (vocab or 0) * 512 * 2
    fields: dict[str, object] = {
        "model_id": "test/balance", "family": "llama", "n_layers": 30, "hidden_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 2, "storage_size": Memory.from_bytes(storage),
        "context_length": 64, "vocab_size": vocab,
    }
    return ModelCard.model_validate(fields | overrides)


def counts(plans: tuple) -> list[int]:  # type: ignore[type-arg]
    return [p.end_layer - p.start_layer for p in plans]


def test_equal_nodes_and_a_big_vocabulary_give_the_last_rank_fewer_layers() -> None:
    big = card(vocab=30_000)  # the head is 30.7 MB: 15 layers' worth
    plans = plan_ring(big, Sharding.Pipeline, RING, [ROOMY, ROOMY])
    assert counts(plans) == [23, 7]  # 46 MB against 14 + 30.7 MB; 22/8 would leave the last rank 46.7
    assert (plans[0].start_layer, plans[0].end_layer, plans[1].end_layer) == (0, 23, 30)
    three = plan_ring(big, Sharding.Pipeline, [*RING, NodeId("c")], [ROOMY] * 3)
    assert counts(three) == [15, 14, 1]
    assert plan_ring(big, Sharding.Pipeline, RING, [ROOMY, ROOMY]) == plans  # pure: the same split every time


def test_tiny_vocabulary_keeps_the_memory_split() -> None:
    tiny = card(vocab=256)  # 0.26 MB of head: not a layer's worth
    assert counts(plan_ring(tiny, Sharding.Pipeline, RING, [ROOMY, ROOMY])) == [15, 15]
    unknown = card(vocab=None)
    uneven = [ROOMY, 3 * ROOMY]
    held = [f - RUNTIME_OVERHEAD_BYTES for f in uneven]  # what each node gives layers beside its runner
    assert counts(plan_ring(unknown, Sharding.Pipeline, RING, uneven)) == allocate_layers(30, held)


def test_tight_memory_keeps_the_memory_split_and_its_arithmetic() -> None:
    big = card(vocab=30_000)  # 90.7 MB; the balanced split (23/7) needs 73.8 MB on rank 0 with its pool
    runner = RUNTIME_OVERHEAD_BYTES  # every rank's, beside its share
    snug = plan_ring(big, Sharding.Pipeline, RING, [60_000_000 + runner] * 2)
    assert all(p.fits for p in snug) and 15 < counts(snug)[0] < 23  # moved only as far as rank 0 still fits
    assert counts(plan_ring(big, Sharding.Pipeline, RING, [50_000_000 + runner] * 2)) == [15, 15]  # 16: no fit
    # a ring that does not fit is planned, and refused, exactly as the memory split has it
    free = [40_000_000 + runner, 50_000_000 + runner]
    short = plan_ring(big, Sharding.Pipeline, RING, free)
    plain = plan_ring(big.model_copy(update={"vocab_size": None}), Sharding.Pipeline, RING, free)
    assert not all(p.fits for p in short) and short == plain


def test_a_faster_node_takes_more_layers() -> None:
    small = card(vocab=256)  # a head too small to move a layer: speeds alone
    assert counts(plan_ring(small, Sharding.Pipeline, RING, [ROOMY, ROOMY], costs=[20, 40])) == [20, 10]
    assert counts(plan_ring(small, Sharding.Pipeline, RING, [ROOMY, ROOMY], costs=[40, 20])) == [10, 20]
    big = card(vocab=30_000)
    slow_last = counts(plan_ring(big, Sharding.Pipeline, RING, [ROOMY, ROOMY], costs=[20, 40]))
    fast_last = counts(plan_ring(big, Sharding.Pipeline, RING, [ROOMY, ROOMY], costs=[40, 20]))
    assert slow_last[1] < 8 < fast_last[1]
    assert speed_costs([0.02, 0.04, 0.021]) == [20, 40, 21]
    assert speed_costs([0.02, None]) is None  # a node never measured: no speeds at all


def test_the_balance_rule_itself() -> None:
    work = DecodeBytes(layer=2, head=10)
    assert rank_work(work, [4, 3]) == [8, 16]
    assert balanced_layers(12, work, [1, 1]) == [9, 3]  # 18 against 6 + 10 (10/2: 20 against 14)
    assert balanced_layers(12, DecodeBytes(2, 0), memory_costs([100, 300])) == allocate_layers(12, [100, 300])
    path = list(steps_toward([6, 6, 6], [9, 8, 1]))
    assert path[-1] == [9, 8, 1] and len(path) == 5 and all(sum(p) == 18 for p in path)
    with pytest.raises(ValueError):
        balanced_layers(2, work, [1, 1, 1])


def test_decode_bytes_from_the_tensors_or_estimated() -> None:
    smol = get_card("HuggingFaceTB/SmolLM2-135M-Instruct")  # Q4_1 layers, a Q8_0 tied head: read from the file
    assert decode_bytes(smol) == DecodeBytes(layer=66_493_440 // 30, head=30_083_328)
    estimated = decode_bytes(card(vocab=30_000))  # bf16, tied: the head is vocab x hidden x 2, layers the rest
    assert estimated == DecodeBytes(layer=2_000_000, head=30_720_000)
    at_load = with_quantization(card(vocab=30_000), "int4")  # the float embedding stays on rank 0, not in work
    layers = decode_bytes(at_load)
    assert layers.head == int(30_000 * 512 * (0.5 + 4 / 64))
    assert layers.layer == pytest.approx(2_000_000 * (0.5 + 4 / 64) / 2, rel=0.01)
    assert decode_bytes(card(vocab=None)).head == 0


def test_placement_weighs_the_nodes_measured_speeds() -> None:
    """place() reads each node's learned DecodeCompute: with a figure for every node the faster takes more
    layers; with one node unmeasured, speeds count as equal (the memory split's weights)."""
    big = card(vocab=30_000)
    roomy = state({"a": ROOMY, "b": ROOMY})

    def layers(s: State) -> list[int]:
        instance = placed(do_place(s, big, min_nodes=2))
        shards = sorted(instance.shard_assignments.runner_to_shard.values(), key=lambda x: x.device_rank)
        return [x.end_layer - x.start_layer for x in shards]

    assert layers(roomy) == [23, 7]
    slow_a = {NodeId("a"): DecodeCompute(step_s_per_gb={1: 0.4}), NodeId("b"): DecodeCompute(step_s_per_gb={1: 0.2})}
    faster_b = layers(roomy.model_copy(update={"node_compute": slow_a}))
    assert faster_b[1] > 7 and sum(faster_b) == 30
    half = {NodeId("a"): DecodeCompute(step_s_per_gb={1: 0.4})}
    assert layers(roomy.model_copy(update={"node_compute": half})) == [23, 7]
