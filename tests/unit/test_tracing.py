"""Runtime tracing without nodes: the flag's decision and apply rule, span batching, the store and janitor."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from skulk.master.decide import events_for_command
from skulk.runner.spans import DECODE_BATCH, SpanBook
from skulk.state.apply import apply
from skulk.tracing.store import TraceStore, chrome_trace, merge_spans, stats
from skulk.types.commands import SetTracingEnabled
from skulk.types.events import IndexedEvent, TracingStateChanged
from skulk.types.ids import CommandId, TaskId
from skulk.types.state import State
from skulk.types.tracing import TraceSpan

pytestmark = pytest.mark.timeout(30)


def test_flag_is_event_sourced_and_idempotent() -> None:
    state = State()
    assert state.tracing_enabled is None
    on = SetTracingEnabled(command_id=CommandId("c"), enabled=True)
    (event,) = events_for_command(state, on, TaskId("t"))
    assert event == TracingStateChanged(enabled=True)
    state = apply(state, IndexedEvent(idx=0, event=event))
    assert state.tracing_enabled is True
    assert events_for_command(state, on, TaskId("t")) == [], "already on: nothing to emit"


def test_decode_steps_are_batched_and_untraced_tasks_cost_nothing() -> None:
    book = SpanBook(rank=1)
    book.step(0.0, 0.1, ["a", "b"], ["a", "b"])  # both admitted before anyone said they are traced
    book.trace("a")  # the RunTask reaches this rank after the step header did
    for i in range(DECODE_BATCH + 3):
        book.step(1.0 + i, 1.5 + i, [], ["a", "b"], wait_s=0.25)
    book.end("a")
    book.end("b")
    spans = book.drain()
    assert [s.name for s in spans] == ["prefill", "decode", "decode"]
    assert all(s.task_id == "a" and s.rank == 1 for s in spans)
    assert [s.args.get("steps") for s in spans[1:]] == [DECODE_BATCH, 3]
    assert [s.args.get("pipelineWaitUs") for s in spans[1:]] == [DECODE_BATCH * 250_000, 750_000]
    assert spans[1].start_us == 1_000_000 and spans[1].duration_us == int((DECODE_BATCH - 0.5) * 1e6)
    book.step(0.0, 1.0, [], ["b"])
    assert book.drain() == []


def span(task: str, rank: int | None, start: int, dur: int, node: str = "n1", name: str = "decode") -> TraceSpan:
    return TraceSpan(task_id=task, name=name, category="runner", rank=rank, start_us=start, duration_us=dur,
                     node_id=node)


def test_store_summaries_stats_and_chrome_export(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, "n1")
    store.add([span("t1", 0, 100, 50, name="prefill"), span("t1", 0, 150, 30)], "m/x", "ChatCompletion")
    (summary,) = store.summaries()
    assert summary["taskId"] == "t1" and summary["modelId"] == "m/x" and summary["spanCount"] == 2
    assert summary["sourceNodes"] == ["n1"] and summary["fileSize"] > 0
    peer = [span("t1", 1, 120, 40, node="n2"), span("t1", 0, 150, 30)]  # one span seen twice
    merged = merge_spans([store.spans("t1")[1], peer])  # type: ignore[index]
    assert len(merged) == 3
    summary_stats = stats("t1", merged)
    assert summary_stats["totalWallTimeUs"] == 80 and summary_stats["sourceNodes"] == ["n1", "n2"]
    assert summary_stats["byRank"]["1"] == {"count": 1, "totalUs": 40}
    waited = stats("t1", [span("t1", 1, 0, 100).model_copy(update={"args": {"pipelineWaitUs": 60}})])
    assert waited["byCategory"]["pipeline_wait"] == {"count": 1, "totalUs": 60}
    raw = chrome_trace("t1", merged)
    assert {e["pid"] for e in raw["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert store.spans("../etc") is None and store.delete(["../etc"]) == []


def test_janitor_honours_retention_days(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, "n1")
    for task in ("old", "new"):
        store.add([span(task, 0, 1, 1)], None, None)
    four_days = time.time() - 4 * 86_400
    os.utime(tmp_path / "old.jsonl", (four_days, four_days))
    assert store.prune(0) == [], "0 disables the janitor"
    assert store.prune(3) == ["old"]
    assert [t["taskId"] for t in store.summaries()] == ["new"]
