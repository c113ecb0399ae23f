"""The speed prediction (master/speed.py) is a pure function of measured compute and links: these pin its
arithmetic, the borrowing of a figure for a node that has not served, and when it declines to predict."""

from __future__ import annotations

import pytest

from skulk.master.speed import (
    COLLECTIVE_STEP_S,
    PIPELINE_HOP_S,
    SPLIT_TOKEN_S,
    RankShare,
    predict_speed,
    step_s_per_gb,
)
from skulk.models.cards import get_card
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.links import DecodeCompute, LinkMeasurement
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

pytestmark = pytest.mark.timeout(10)

A, B, C = NodeId("a"), NodeId("b"), NodeId("c")
CARD = ModelCard(model_id="m", family="llama", n_layers=12, hidden_size=768, num_attention_heads=12,  # type: ignore[arg-type]
                 num_key_value_heads=4, storage_size=Memory.from_bytes(100_000_000))
ONE_GB = 0.1  # CARD is 0.1 GB


def compute(single: float, eight: float | None = None) -> DecodeCompute:
    """single/eight: seconds per step of the whole CARD at batch 1 / 8."""
    figures = {1: single / ONE_GB} | ({8: eight / ONE_GB} if eight is not None else {})
    return DecodeCompute(step_s_per_gb=figures, steps=10)


def link(rtt_ms: float, mbps: float | None = 1000.0) -> LinkMeasurement:
    return LinkMeasurement(rtt_ms=rtt_ms, probe_rtt_ms=rtt_ms + 1, bandwidth_mbps=mbps, measured_at_s=1.0)


def test_one_rank_is_its_own_measured_step() -> None:
    got = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 12)], {A: compute(0.010, 0.020)}, {})
    assert got is not None
    assert got.decode_tps == pytest.approx(100.0)
    assert got.aggregate_tps == pytest.approx(8 / 0.020)
    assert got.borrowed == ()


def test_pipeline_single_stream_adds_one_hop_per_rank_and_the_token_back() -> None:
    links = {A: {B: link(0.5, None)}, B: {A: link(0.5, None)}}
    got = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 6), RankShare(B, 6)], {A: compute(0.010)}, links)
    assert got is not None
    hop = 0.00025 + PIPELINE_HOP_S
    node_path = 2 * SPLIT_TOKEN_S  # the token forwarded by the sampler's node, received by the serving one
    assert got.decode_tps == pytest.approx(1 / (0.005 + 0.005 + 2 * hop + node_path))
    assert got.borrowed == (B,)  # b never served: it borrowed a's figure
    assert got.aggregate_tps is None  # nobody served 8 streams


def test_bandwidth_prices_the_hidden_state_message() -> None:
    slow = {A: {B: link(0.0, 1.0)}}  # 1 Mbit/s: a 768-wide bf16 row is 12.3 ms
    got = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 6), RankShare(B, 6)], {A: compute(0.010)}, slow)
    assert got is not None
    expected = 0.010 + 768 * 2 * 8 / 1e6 + 24 * 8 / 1e6 + 2 * PIPELINE_HOP_S + 2 * SPLIT_TOKEN_S
    assert got.decode_tps == pytest.approx(1 / expected)


def test_uneven_layers_and_nodes_weigh_each_rank_by_its_share() -> None:
    figures = {A: compute(0.010), B: compute(0.020)}
    links = {A: {B: link(0.1)}}
    got = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 9), RankShare(B, 3)], figures, links)
    assert got is not None
    compute_s = 0.010 * 9 / 12 + 0.020 * 3 / 12
    hops = 2 * (0.00005 + PIPELINE_HOP_S)  # hidden states on, the token back; the wire's bytes are negligible
    assert 1 / got.decode_tps == pytest.approx(compute_s + hops + 2 * SPLIT_TOKEN_S, abs=0.0001)


def test_pipelined_micro_batches_overlap_the_ranks() -> None:
    links = {A: {B: link(0.0, None)}}
    figures = {A: compute(0.010, 0.016), B: compute(0.010, 0.016)}
    ranks = [RankShare(A, 6), RankShare(B, 6)]
    plain = predict_speed(CARD, Sharding.Pipeline, ranks, figures, links, micro_batches=False)
    piped = predict_speed(CARD, Sharding.Pipeline, ranks, figures, links, micro_batches=True)
    assert plain is not None and piped is not None and plain.aggregate_tps and piped.aggregate_tps
    # one rank computes at a time
    assert plain.aggregate_tps == pytest.approx(8 / (0.016 + 2 * PIPELINE_HOP_S + 2 * 8 * SPLIT_TOKEN_S))
    # four rows per micro-batch (between the batch-1 and batch-8 figures), half the model per rank; a round is
    # both micro-batches through the busier rank, or one micro-batch's trip round the ring if that is longer
    four_rows = (0.010 + 0.006 * 3 / 7) / 2 + 4 * SPLIT_TOKEN_S
    assert piped.aggregate_tps == pytest.approx(8 / max(2 * four_rows, 2 * four_rows + 2 * PIPELINE_HOP_S))
    assert piped.aggregate_tps > plain.aggregate_tps


def test_tensor_pays_two_all_reduces_per_layer_and_loses_to_pipeline_on_slow_links() -> None:
    ranks = [RankShare(A, 12), RankShare(B, 12)]
    figures = {A: compute(0.010), B: compute(0.010)}
    fast = predict_speed(CARD, Sharding.Tensor, ranks, figures, {A: {B: link(0.02)}})
    wifi = predict_speed(CARD, Sharding.Tensor, ranks, figures, {A: {B: link(2.0)}})
    pipe = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 6), RankShare(B, 6)], figures, {A: {B: link(2.0)}})
    assert fast is not None and wifi is not None and pipe is not None
    assert wifi.decode_tps < fast.decode_tps and wifi.decode_tps < pipe.decode_tps
    one_way = 0.001 + COLLECTIVE_STEP_S + 768 * 4 / 2 * 8 / 1e9
    assert 1 / wifi.decode_tps == pytest.approx(
        0.005 + SPLIT_TOKEN_S + 2 * 12 * 2 * one_way + 0.001 + COLLECTIVE_STEP_S + 24 * 8 / 1e9, rel=1e-6)


def test_no_prediction_without_any_compute_or_with_an_unmeasured_link() -> None:
    ranks = [RankShare(A, 6), RankShare(B, 6)]
    assert predict_speed(CARD, Sharding.Pipeline, ranks, {}, {A: {B: link(0.1)}}) is None
    assert predict_speed(CARD, Sharding.Pipeline, ranks, {A: compute(0.01)}, {A: {C: link(0.1)}}) is None
    assert predict_speed(CARD, Sharding.Pipeline, [], {A: compute(0.01)}, {}) is None


def test_the_link_as_either_end_measured_it() -> None:
    ranks = [RankShare(A, 6), RankShare(B, 6)]
    one = predict_speed(CARD, Sharding.Pipeline, ranks, {A: compute(0.01)}, {A: {B: link(1.0)}})
    other = predict_speed(CARD, Sharding.Pipeline, ranks, {A: compute(0.01)}, {B: {A: link(1.0)}})
    assert one is not None and other is not None and one.decode_tps == pytest.approx(other.decode_tps)
    # both ends measured it: the shorter round trip (a probe answered late by a busy node only errs long)
    both = predict_speed(CARD, Sharding.Pipeline, ranks, {A: compute(0.01)}, {A: {B: link(4.0)}, B: {A: link(1.0)}})
    assert both is not None and both.decode_tps == pytest.approx(one.decode_tps)


def test_step_figures_between_and_beyond_the_measured_batches() -> None:
    figures = DecodeCompute(step_s_per_gb={1: 1.0, 8: 2.4})
    assert step_s_per_gb(figures, 1) == 1.0
    assert step_s_per_gb(figures, 4) == pytest.approx(1.6)
    assert step_s_per_gb(figures, 15) == pytest.approx(3.8)
    assert step_s_per_gb(DecodeCompute(step_s_per_gb={1: 1.0}), 8) is None  # one batch alone says nothing of 8
    assert step_s_per_gb(DecodeCompute(step_s_per_gb={4: 1.0}), 1) == 1.0
    assert step_s_per_gb(DecodeCompute(), 1) is None


def test_one_rank_gets_its_measured_drafts_a_split_does_not() -> None:
    figures = {A: DecodeCompute(step_s_per_gb={1: 0.1}, tokens_per_step={1: 2.0}, steps=5)}  # 10 ms a step
    one = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 12)], figures, {})
    split = predict_speed(CARD, Sharding.Pipeline, [RankShare(A, 6), RankShare(B, 6)], figures,
                          {A: {B: link(0.0, None)}})
    assert one is not None and split is not None
    assert one.decode_tps == pytest.approx(200.0)
    assert split.decode_tps == pytest.approx(1 / (0.010 + 2 * PIPELINE_HOP_S + 2 * SPLIT_TOKEN_S))


def test_the_last_rank_reads_the_head() -> None:
    smol = get_card("HuggingFaceTB/SmolLM2-135M-Instruct")  # 30 layers of 2.2 MB and a 30.1 MB head
    gb = smol.storage_size.in_bytes / 1e9
    figures = {A: compute(0.010 * ONE_GB / gb, 0.016 * ONE_GB / gb), B: compute(0.010 * ONE_GB / gb)}
    links = {A: {B: link(0.0, None)}}
    halves = predict_speed(smol, Sharding.Pipeline, [RankShare(A, 15), RankShare(B, 15)], figures, links,
                           micro_batches=True)
    balanced = predict_speed(smol, Sharding.Pipeline, [RankShare(A, 22), RankShare(B, 8)], figures, links,
                             micro_batches=True)
    assert halves is not None and balanced is not None and halves.aggregate_tps and balanced.aggregate_tps
    layer, head = 66_493_440 // 30, 30_083_328
    last = (15 * layer + head) / (30 * layer + head)  # 0.66 of the step, not half
    four_rows = 0.010 + 0.006 * 3 / 7
    assert halves.aggregate_tps == pytest.approx(8 / (2 * (four_rows * last + 4 * SPLIT_TOKEN_S)), rel=1e-3)
    assert balanced.aggregate_tps > 1.2 * halves.aggregate_tps
    assert balanced.decode_tps == pytest.approx(halves.decode_tps)  # one stream reads every byte either way
