"""SKULK_FAULT parsing and the injector's trip rules; SKULK_FLIGHT_RECORDER's switch."""

from __future__ import annotations

import logging
import threading

import pytest

from skulk.runner.fault import (
    Fault,
    FaultError,
    FaultInjector,
    fault_from_setting,
    parse_fault,
    recording_enabled,
)
from skulk.runner.recorder import FlightRecorder
from skulk.types.diagnostics import RunnerContext
from skulk.types.ids import InstanceId, NodeId, RunnerId


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("stall:decode_stream", Fault("decode_stream")),
        ("stall:decode_stream:rank=1", Fault("decode_stream", rank=1)),
        ("stall:prefill_pipeline:after=2.5", Fault("prefill_pipeline", after_s=2.5)),
        ("stall:decode_barrier:after=3:rank=0", Fault("decode_barrier", rank=0, after_s=3.0)),
        (" stall:warmup:rank=2 ", Fault("warmup", rank=2)),
    ],
)
def test_parse_valid(value: str | None, expected: Fault | None) -> None:
    assert parse_fault(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "crash:decode_stream",
        "stall",
        "stall:",
        "stall:decoding",
        "stall:decode_stream:rank=x",
        "stall:decode_stream:rank=-1",
        "stall:decode_stream:after=-2",
        "stall:decode_stream:after=nan",
        "stall:decode_stream:after=inf",
        "stall:decode_stream:rank=1:rank=2",
        "stall:decode_stream:who=1",
        "stall:decode_stream:1",
    ],
)
def test_parse_invalid_raises(value: str) -> None:
    with pytest.raises(FaultError):
        parse_fault(value)


def test_invalid_setting_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="skulk.runner.fault"):
        assert fault_from_setting("stall:nowhere") is None
    assert len(caplog.records) == 1 and "SKULK_FAULT" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("yes", True), ("0", False), ("off", False), (" False ", False)]
)
def test_recording_enabled(value: str | None, on: bool) -> None:
    assert recording_enabled(value) is on


def test_trip_rules_rank_phase_and_arming() -> None:
    injector = FaultInjector(Fault("decode_stream", rank=1), rank=1, flush=lambda: None)
    assert not injector.should_trip("decode_stream", 1e9), "serving phases wait for arm()"
    injector.arm()
    assert injector.should_trip("decode_stream", 1e9)
    assert not injector.should_trip("prefill_pipeline", 1e9)
    other_rank = FaultInjector(Fault("decode_stream", rank=1), rank=0, flush=lambda: None)
    other_rank.arm()
    assert not other_rank.should_trip("decode_stream", 1e9)
    any_rank = FaultInjector(Fault("warmup"), rank=3, flush=lambda: None)
    assert any_rank.should_trip("warmup", 1e9), "startup phases are armed from the start"


def test_after_counts_from_arming() -> None:
    injector = FaultInjector(Fault("decode_stream", after_s=5.0), rank=0, flush=lambda: None)
    injector.arm()
    assert injector.armed_at is not None
    assert not injector.should_trip("decode_stream", injector.armed_at + 4.9)
    assert injector.should_trip("decode_stream", injector.armed_at + 5.0)


def _recorder() -> FlightRecorder:
    context = RunnerContext(
        node_id=NodeId("n1"),
        runner_id=RunnerId("r1"),
        pid=1,
        instance_id=InstanceId("i1"),
        model_id="m",
        rank=1,
        world_size=2,
        start_layer=4,
        end_layer=8,
        n_layers=8,
    )
    return FlightRecorder(context)


def test_stall_flushes_the_phase_entry_first_and_blocks_without_exiting() -> None:
    """The supervisor must see the rank in the stalled phase, so the entry goes out before the stall."""
    recorder = _recorder()
    flushed: list[list[str]] = []
    injector = FaultInjector(
        Fault("decode_stream", rank=1), rank=1, flush=lambda: flushed.append([e.phase for e in recorder.drain()])
    )
    injector.arm()
    recorder.on_enter = injector.on_enter
    recorder.record("idle", "ready")
    assert flushed == []
    stalled = threading.Thread(target=recorder.record, args=("decode_stream", "decode"), daemon=True)
    stalled.start()
    stalled.join(0.5)
    assert stalled.is_alive(), "the stalled thread must stay blocked"
    assert flushed == [["idle", "decode_stream"]]
    assert injector.tripped
    injector._never.set()  # release the test thread
    stalled.join(5)
    assert not stalled.is_alive()


def test_recording_disabled_still_reports_phase_changes() -> None:
    recorder = _recorder()
    recorder.enabled = False
    seen: list[str] = []
    recorder.on_enter = seen.append
    recorder.record("idle", "ready")
    recorder.record("idle", "again")
    recorder.record("decode_stream", "decode")
    assert seen == ["idle", "decode_stream"] and recorder.drain() == []
