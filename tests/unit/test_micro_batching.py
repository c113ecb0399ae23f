"""The micro-batch decision rule (engines/micro_batching.py), rank 0's measured pace that feeds it in the engine
(engines/torch/pace.py), and the prediction following the same rule (master/speed.py)."""

from __future__ import annotations

import pytest
import torch

from skulk.engines.micro_batching import (
    MICRO_BATCHES_ENV,
    Hops,
    Shares,
    forced_micro_batches,
    micro_batches_for,
    period_s,
)
from skulk.engines.torch.flight import Flights
from skulk.engines.torch.options import Shard
from skulk.engines.torch.pace import BLOCKED_S, Pace, head_in_layers
from skulk.master.speed import RankShare, predict_speed
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.links import DecodeCompute, LinkMeasurement
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

pytestmark = pytest.mark.timeout(10)

# a whole model's forward by rows (ms), as measured for the 100M int4 model on one core: weight-bound (a 4-row
# forward costs 0.7 of an 8-row one, and 1 row more than 2: the int4 kernel's one-row path)
WEIGHT_BOUND = {1: 6.2, 2: 5.7, 4: 7.1, 8: 10.0, 16: 17.1}
FLAT = {1: 9.0, 2: 9.2, 4: 9.5, 8: 10.0}  # more weight-bound still (float32 weights)


def split(table: dict[int, float], first: float = 0.5) -> Shares:
    """Two ranks holding `first` and the rest of the model."""
    return lambda rows: [table[rows] * first / 1000, table[rows] * (1 - first) / 1000] if rows in table else None


def hops(seconds: float) -> Hops:
    return lambda rows: seconds


def test_skulk_micro_batches_forces_the_rule_either_way_and_unset_leaves_it_to_decide(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert forced_micro_batches({MICRO_BATCHES_ENV: "always"}) is True
    assert forced_micro_batches({MICRO_BATCHES_ENV: " Never "}) is False
    assert forced_micro_batches({MICRO_BATCHES_ENV: "sometimes"}) is None
    assert forced_micro_batches({}) is None
    shard = Shard(rank=0, world_size=2, kind="pipeline")
    monkeypatch.setenv(MICRO_BATCHES_ENV, "always")  # a node's runner builds its engine under its node's env
    assert Flights(shard, Pace(2, 6, 12), list, lambda reqs, rows: None).micro_batches is True
    monkeypatch.delenv(MICRO_BATCHES_ENV)
    assert Flights(shard, Pace(2, 6, 12), list, lambda reqs, rows: None).micro_batches is None


def test_the_periods_follow_the_formula() -> None:
    shares = lambda rows: [0.003, 0.001] if rows == 4 else [0.005, 0.002]  # noqa: E731
    assert period_s(shares, hops(0.001), 8, 1) == pytest.approx(0.005 + 0.002 + 0.001)
    # two micro-batches of 4: the busier rank's two parts, or one micro-batch round the ring if longer
    assert period_s(shares, hops(0.001), 8, 2) == pytest.approx(max(2 * 0.003, 0.003 + 0.001 + 0.001))
    assert period_s(shares, hops(0.004), 8, 2) == pytest.approx(0.003 + 0.001 + 0.004)
    assert period_s(lambda rows: None, hops(0.0), 8, 2) is None
    assert period_s(shares, lambda rows: None, 8, 1) is None


def test_even_ranks_pipeline_while_a_smaller_forward_costs_less() -> None:
    """Each rank on its own machine: two micro-batches make the round about t(R/2) instead of t(R)."""
    assert micro_batches_for(split(WEIGHT_BOUND), hops(0.0003), 8, 2) == 2
    assert micro_batches_for(split(WEIGHT_BOUND), hops(0.0003), 16, 2) == 2


def test_a_forward_that_costs_no_less_at_fewer_rows_or_an_uneven_split_stays_plain() -> None:
    assert micro_batches_for(split(WEIGHT_BOUND), hops(0.0003), 2, 2) == 1  # t(1) > t(2)
    # one rank holds 5/6 of the model: twice its 4-row part is longer than both parts at 8 rows
    assert micro_batches_for(split(WEIGHT_BOUND, 5 / 6), hops(0.0003), 8, 2) == 1
    assert micro_batches_for(split(WEIGHT_BOUND, 5 / 6), hops(0.008), 8, 2) == 2  # unless it hides long hops


def test_too_few_rows_one_rank_or_a_missing_figure() -> None:
    assert micro_batches_for(split(WEIGHT_BOUND), hops(0.0), 1, 2) == 1
    assert micro_batches_for(split(WEIGHT_BOUND), hops(0.0), 8, 1) == 1
    assert micro_batches_for(split({8: 8.0}), hops(0.0), 8, 2) is None  # nothing known at 4 rows


def test_the_pace_is_rank_zeros_part_and_the_trip_less_the_later_parts() -> None:
    pace = Pace(world_size=2, own_layers=4, total_layers=12)  # the later rank holds 8 layers: twice rank 0's part
    assert pace.shares(4) is None and pace.hops(4) is None
    pace.part(4, 0.002)
    pace.part(4, 0.004)  # a running average: 0.002 + 0.2 * 0.002
    assert pace.shares(4) == pytest.approx([0.0024, 0.0048])
    pace.tokens_back(4, 0.010, waited=BLOCKED_S / 2)  # the tokens were already there: says nothing of the trip
    assert pace.hops(4) is None
    pace.tokens_back(4, 0.006, waited=0.001)
    assert pace.hops(4) == pytest.approx(0.006 - 0.0048)
    pace.part(8, 0.003)
    assert pace.shares(6) == pytest.approx([0.0027, 0.0054])  # between the row counts measured


def test_the_pace_weighs_the_samplers_lm_head_by_bytes() -> None:
    """The last rank's lm_head counts as its bytes in rank 0's layers: SmolLM2's 8-bit head is ~16 of its 4-bit
    layers, so over 15/15 layers the sampler's part is about twice rank 0's, and a middle rank holds no head."""
    pace = Pace(world_size=3, own_layers=4, total_layers=12, head_layers=2.0)
    pace.part(4, 0.004)
    assert pace.shares(4) == pytest.approx([0.004, 0.004, 0.006])
    model, whole = torch.nn.Module(), torch.zeros(128)  # 512 bytes, and a view of them counted once
    model.embed_tokens = torch.nn.Module()
    model.embed_tokens.register_buffer("whole", whole)
    model.embed_tokens.register_buffer("part", whole[:64])
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(8, 8, bias=False) for i in range(2)})  # 256 bytes
    assert head_in_layers(model) == pytest.approx(2.0)
    assert head_in_layers(object()) == 0.0  # an MLX stage: no torch embedding, its pace counts layers alone


A, B = NodeId("a"), NodeId("b")
CARD = ModelCard(model_id="m", family="llama", n_layers=12, hidden_size=768, num_attention_heads=12,  # type: ignore[arg-type]
                 num_key_value_heads=4, storage_size=Memory.from_bytes(100_000_000))


def test_the_prediction_decides_as_the_engine_does() -> None:
    """An uneven split of weight-bound compute: micro-batches on a short link would lose, so the engine (and so the
    prediction) keeps the plain step; on a slow link they hide the hops, and both pipeline."""
    compute = {A: DecodeCompute(step_s_per_gb={r: ms / 1000 / 0.1 for r, ms in FLAT.items()}, steps=10)}
    ranks = [RankShare(A, 11), RankShare(B, 1)]
    for rtt_ms in (0.1, 8.0):
        links = {A: {B: LinkMeasurement(rtt_ms=rtt_ms, probe_rtt_ms=rtt_ms, bandwidth_mbps=None, measured_at_s=1.0)}}
        rule = predict_speed(CARD, Sharding.Pipeline, ranks, compute, links)
        plain = predict_speed(CARD, Sharding.Pipeline, ranks, compute, links, micro_batches=False)
        piped = predict_speed(CARD, Sharding.Pipeline, ranks, compute, links, micro_batches=True)
        assert rule is not None and plain is not None and piped is not None
        assert rule.aggregate_tps is not None and plain.aggregate_tps and piped.aggregate_tps
        assert rule.aggregate_tps == pytest.approx(max(plain.aggregate_tps, piped.aggregate_tps))
        assert (rule.aggregate_tps == piped.aggregate_tps) == (rtt_ms > 1), rtt_ms
