"""A runner's runtime overhead, as its node measured it (issue 41): what the runner reports, what the node keeps
and reports, and what placement then counts for that node's ranks."""

from __future__ import annotations

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES, SHARD_SLACK, planned_base
from skulk.master.shard_plan import plan_ring
from skulk.models.cards import get_card
from skulk.runner.messages import Footprint
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.memory import Memory
from skulk.types.node_info import MemoryUsage, RunnerOverhead, rank_role
from skulk.worker.overheads import OverheadMeter

MIB = 2**20


def test_the_overhead_is_what_is_resident_besides_weights_and_zeroed_kv() -> None:
    assert Footprint(resident=900 * MIB, weights=400 * MIB, kv=50 * MIB).overhead == 450 * MIB
    assert Footprint(resident=10, weights=400, kv=50).overhead == 0  # never negative


def test_the_node_keeps_the_latest_per_engine_and_role_and_calibration_never_overrides_a_runner() -> None:
    meter = OverheadMeter()
    assert meter.snapshot() is None  # nothing measured: node info leaves the key out
    meter.record("torch", "first", 430 * MIB)
    meter.calibrated("torch", "first", 999 * MIB)  # a runner measured first: it stands
    meter.calibrated("torch", "later", 340 * MIB)
    meter.record("torch", "later", 339 * MIB)  # a runner replaces the calibration
    got = {(o.engine, o.role): o.overhead.in_bytes for o in meter.snapshot() or []}
    assert got == {("torch", "first"): 430 * MIB, ("torch", "later"): 339 * MIB}
    assert [rank_role(r) for r in (0, 1, 2)] == ["first", "later", "later"]


def test_a_later_rank_not_yet_measured_counts_the_first_ranks_figure() -> None:
    usage = MemoryUsage(ram_total=Memory.from_bytes(8 << 30), ram_available=Memory.from_bytes(4 << 30),
                        runner_overheads=[RunnerOverhead(engine="torch", role="first",
                                                         overhead=Memory.from_bytes(430 * MIB))])
    assert usage.runner_overhead("torch", "first") == usage.runner_overhead("torch", "later") == 430 * MIB
    assert usage.runner_overhead("mlx", "first") is None
    assert "runnerOverheads" not in MemoryUsage(ram_total=Memory(), ram_available=Memory()).model_dump()


def test_placement_counts_each_nodes_measured_runtime_and_exact_weights_as_they_are() -> None:
    card = get_card("meta-llama/Llama-3.2-1B-Instruct")
    assert card is not None and card.memory is not None
    ring, free = [NodeId("a"), NodeId("b")], [20 << 30, 20 << 30]
    default = plan_ring(card, Sharding.Pipeline, ring, free)
    measured = plan_ring(card, Sharding.Pipeline, ring, free, runtimes=[430 * MIB, None])
    assert [p.runtime_bytes for p in measured] == [430 * MIB, RUNTIME_OVERHEAD_BYTES]
    assert [p.base for p in measured] == [p.weights_share + p.runtime_bytes for p in measured]
    assert (measured[0].start_layer, measured[0].end_layer) == (default[0].start_layer, default[0].end_layer)
    assert measured[0].base == default[0].base - (RUNTIME_OVERHEAD_BYTES - 430 * MIB)
    assert planned_base(1000, 7, exact=False) == int(SHARD_SLACK * 1000) + 7  # an estimate keeps its slack
