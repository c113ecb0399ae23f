"""The node's link meter and compute learner (worker/links.py, worker/compute.py), and how their figures reach
state (node info) and leave it with the node."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from skulk.state.apply import apply
from skulk.types.events import IndexedEvent, NodeGatheredInfo, NodeTimedOut
from skulk.types.ids import NodeId, RunnerId
from skulk.types.links import DecodeCompute, LinkMeasurement
from skulk.types.node_info import NodeInfo
from skulk.types.state import State
from skulk.worker.compute import ComputeLearner
from skulk.worker.links import LinkMeter, worth_reporting

pytestmark = pytest.mark.timeout(10)
A, B, C = NodeId("a"), NodeId("b"), NodeId("c")
GB = 1_000_000_000


def test_round_trip_is_the_median_less_the_http_stacks_own_cost() -> None:
    meter = LinkMeter()
    for sample in (0.003, 0.002, 0.100, 0.0025):  # one slow reply does not move the median
        meter.add_rtt(B, sample, now=5.0)
    meter.add_self_rtt(0.0015)
    link = meter.snapshot()[B]
    assert link.probe_rtt_ms == pytest.approx(2.75)
    assert link.rtt_ms == pytest.approx(1.25)
    assert link.bandwidth_mbps is None and link.measured_at_s == 5.0
    meter.add_self_rtt(0.010)
    meter.add_self_rtt(0.010)  # the stacks slower than the link: the floor, never a negative round trip
    assert meter.snapshot()[B].rtt_ms == pytest.approx(0.01)


def test_bandwidth_is_due_again_after_its_interval_whether_or_not_the_read_worked() -> None:
    meter = LinkMeter()
    meter.add_rtt(B, 0.001, now=1.0)
    assert meter.bandwidth_due(B, 100.0)
    meter.bandwidth_tried(B, 100.0)
    assert not meter.bandwidth_due(B, 101.0)
    assert meter.bandwidth_due(B, 131.0)
    meter.add_bandwidth(B, 940.0, now=102.0)
    assert meter.snapshot()[B].bandwidth_mbps == 940.0
    meter.forget_except({C})
    assert meter.snapshot() == {}


def link(rtt: float, mbps: float | None = None) -> LinkMeasurement:
    return LinkMeasurement(rtt_ms=rtt, probe_rtt_ms=rtt, bandwidth_mbps=mbps, measured_at_s=1.0)


def test_only_a_real_move_is_worth_a_node_info_event() -> None:
    assert not worth_reporting({B: link(1.0, 900)}, {B: link(1.1, 950)})  # jitter
    assert not worth_reporting({B: link(0.1, 900)}, {B: link(0.3, 900)})  # loopback jitter: 3x, but 0.2 ms
    assert worth_reporting({B: link(1.0, 900)}, {B: link(2.0, 900)})
    assert worth_reporting({B: link(1.0, 900)}, {B: link(1.0, 300)})
    assert worth_reporting({B: link(1.0)}, {B: link(1.0, 300)})  # first bandwidth read
    assert worth_reporting({B: link(1.0)}, {B: link(1.0), C: link(1.0)})  # a new peer
    assert not worth_reporting(None, {})


def test_compute_is_learned_from_consecutive_steps_of_one_batch() -> None:
    learner, runner = ComputeLearner(), RunnerId("r")
    assert learner.snapshot() is None
    now = 10.0
    for _ in range(5):  # one stream: a step every 20 ms of a 0.5 GB model
        learner.on_step(runner, 1, GB // 2, now)
        now += 0.020
    learner.on_step(runner, 3, GB // 2, now)  # the batch changed: no sample across it
    now += 0.5
    learner.on_step(runner, 3, GB // 2, now)  # a prefill rode along: far slower than its batch's others
    for _ in range(4):
        now += 0.030
        learner.on_step(runner, 3, GB // 2, now)
    now += 5.0
    learner.on_step(runner, 3, GB // 2, now)  # idle in between: not a step
    figures = learner.snapshot()
    assert figures is not None
    assert figures.step_s_per_gb[1] == pytest.approx(0.040)
    assert figures.step_s_per_gb[3] == pytest.approx(0.060)  # the prefill step is left out


def test_late_arrivals_average_out_to_the_runners_pace() -> None:
    learner, runner = ComputeLearner(), RunnerId("r")
    now = 0.0
    for gap in [0.001, 0.039] * 10:  # the loop was late: every other message came right after the one before
        now += gap
        learner.on_step(runner, 1, GB, now)
    figures = learner.snapshot()
    assert figures is not None and figures.step_s_per_gb[1] == pytest.approx(0.020, rel=0.1)


def event(index: int, ev: NodeGatheredInfo | NodeTimedOut) -> IndexedEvent:
    return IndexedEvent(idx=index, event=ev)


def test_node_info_carries_links_and_compute_into_state_and_a_lost_node_takes_them_along() -> None:
    when = datetime.now(UTC)
    compute = DecodeCompute(step_s_per_gb={1: 0.04}, steps=3)
    state = apply(State(), event(0, NodeGatheredInfo(node_id=A, when=when,
                                                      info=NodeInfo(links={B: link(0.5)}, compute=compute))))
    state = apply(state, event(1, NodeGatheredInfo(node_id=B, when=when, info=NodeInfo(links={A: link(0.6)}))))
    assert state.node_links == {A: {B: link(0.5)}, B: {A: link(0.6)}}
    assert state.node_compute == {A: compute}
    state = apply(state, event(2, NodeTimedOut(node_id=B)))
    assert state.node_links == {A: {}}
    assert state.node_compute == {A: compute}


def test_a_step_that_started_a_request_is_not_a_decode_step() -> None:
    learner, runner = ComputeLearner(), RunnerId("r")
    learner.on_step(runner, 1, GB, 0.0)
    learner.on_step(runner, 1, GB, 0.300, decode_only=False)  # the next request's first token: idle + prefill
    learner.on_step(runner, 1, GB, 0.320)
    figures = learner.snapshot()
    assert figures is not None and figures.step_s_per_gb == {1: pytest.approx(0.020)}


def test_accepted_drafts_are_tokens_of_one_stream_not_more_streams() -> None:
    learner, runner = ComputeLearner(), RunnerId("r")
    now = 0.0
    for tokens in (1, 3, 2, 2):  # one stream; speculative steps give it 1-3 tokens each
        learner.on_step(runner, 1, GB, now, tokens=tokens)
        now += 0.010
    figures = learner.snapshot()
    assert figures is not None
    assert figures.step_s_per_gb == {1: pytest.approx(0.010)}
    assert figures.tokens_per_step == {1: pytest.approx(7 / 3, abs=0.001)}
