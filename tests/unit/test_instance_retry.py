"""Restarts are a budget over time: InstanceRetrying/InstanceFailed decisions and rules (pure), the worker's
plan for a retried instance, the supervisor's single-rank budget, and the API's fast 503 for a failed one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from skulk.api.chat_session import require_instance
from skulk.api.errors import ApiError
from skulk.master.decide import events_for_command, events_for_unhealthy_instances, pick_instance
from skulk.types.commands import StartChatCompletion
from skulk.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceFailed,
    InstanceRetrying,
    RunnerStatusUpdated,
    TaskCreated,
    TaskFailed,
)
from skulk.types.ids import CommandId, InstanceId, NodeId, RunnerId, TaskId
from skulk.types.runners import RunnerFailed, RunnerReady
from skulk.types.state import State
from skulk.worker.plan import LocalRunner, RestartRunner, StartRunner, plan
from skulk.worker.supervisor import restart_delay

from .factories import CARD, applied, chat_task, instance

pytestmark = pytest.mark.timeout(30)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
A = InstanceId("a")


def failed(runner: str, at: datetime, attempt: int = 0, why: str = "rank died") -> RunnerStatusUpdated:
    status = RunnerFailed(error_message=why, at=at, attempt=attempt)
    return RunnerStatusUpdated(runner_id=RunnerId(runner), runner_status=status)


def two_ranks(*events: Event) -> State:
    ready = [RunnerStatusUpdated(runner_id=RunnerId(r), runner_status=RunnerReady()) for r in ("r-n1", "r-n2")]
    return applied(InstanceCreated(instance=instance("a", ("n1", "n2"))), *ready, *events)


def crash_and_decide(state: State, at: datetime, **budget: float) -> tuple[State, list[Event]]:
    attempt = state.instance_retries[A].attempt if A in state.instance_retries else 0
    state = applied(failed("r-n2", at, attempt), state=state)
    events = events_for_unhealthy_instances(state, **budget)  # type: ignore[arg-type]
    return applied(*events, state=state), events


def test_a_failed_rank_retries_the_instance_and_fails_its_open_tasks() -> None:
    state = two_ranks(TaskCreated(task=chat_task("t1", "a")))
    state, events = crash_and_decide(state, T0)
    assert [type(e) for e in events] == [TaskFailed, InstanceRetrying]
    assert isinstance(events[0], TaskFailed) and events[0].retryable and "restarting" in events[0].error_message
    assert events[1] == InstanceRetrying(instance_id=A, failure_error="n2: rank died", at=T0)
    assert "a" in state.instances and state.runners == {}, "the instance stays, its runners go"
    assert state.instance_retries[A].attempt == 1 and state.instance_retries[A].recent == [T0]
    assert events_for_unhealthy_instances(state) == [], "answered once: no runner is failed any more"


def test_a_late_failure_of_the_previous_attempt_is_ignored() -> None:
    state, _ = crash_and_decide(two_ranks(), T0)
    state = applied(failed("r-n1", T0 + timedelta(seconds=1), attempt=0), state=state)
    assert "r-n1" not in state.runners and events_for_unhealthy_instances(state) == []
    state = applied(failed("r-n1", T0 + timedelta(seconds=2), attempt=1), state=state)
    assert isinstance(state.runners[RunnerId("r-n1")], RunnerFailed)


def test_budget_is_over_time_not_a_lifetime_count() -> None:
    state = two_ranks()
    for i in range(6):  # six crashes, each 61 s after the last: always within budget
        state, events = crash_and_decide(state, T0 + timedelta(seconds=61 * i))
        assert isinstance(events[-1], InstanceRetrying), i
    assert state.instance_retries[A].attempt == 6


def test_over_budget_the_instance_fails_for_good_and_stays_visible() -> None:
    state = two_ranks()
    for i in range(3):
        state, events = crash_and_decide(state, T0 + timedelta(seconds=i))
        assert isinstance(events[-1], InstanceRetrying)
    state = applied(TaskCreated(task=chat_task("t1", "a")), state=state)
    state, events = crash_and_decide(state, T0 + timedelta(seconds=3))
    assert [type(e) for e in events] == [TaskFailed, InstanceFailed]
    assert "a" in state.instances and isinstance(state.runners[RunnerId("r-n2")], RunnerFailed)
    assert "4 failures within 60 s" in (state.instance_retries[A].failed or "")
    assert events_for_unhealthy_instances(state) == [], "failed for good: no more retries"


def test_budget_and_window_are_parameters() -> None:
    state, events = crash_and_decide(two_ranks(), T0, budget=0)
    assert isinstance(events[-1], InstanceFailed)
    state = two_ranks()
    for i in range(4):  # window 2 s, crashes 3 s apart
        state, events = crash_and_decide(state, T0 + timedelta(seconds=3 * i), budget=1, window_s=2.0)
        assert isinstance(events[-1], InstanceRetrying)


def test_retrying_a_missing_instance_is_a_noop_and_delete_forgets_retries() -> None:
    state = applied(InstanceRetrying(instance_id=A, failure_error="x", at=T0))
    assert state.instance_retries == {} and state.instances == {}
    state, _ = crash_and_decide(two_ranks(), T0)
    assert applied(InstanceDeleted(instance_id=A), state=state).instance_retries == {}


def test_workers_restart_every_rank_of_a_retried_instance() -> None:
    state, _ = crash_and_decide(two_ranks(), T0)
    for node in ("n1", "n2"):
        runner = RunnerId(f"r-{node}")
        actions = plan(state, NodeId(node), {runner: LocalRunner(runner, attempt=0)})
        assert actions == [RestartRunner(state.instances[A], runner, 1, "n2: rank died")]
        assert plan(state, NodeId(node), {runner: LocalRunner(runner, attempt=1)}) == []
    assert plan(state, NodeId("n1"), {}) == [StartRunner(state.instances[A], RunnerId("r-n1"), 1)]


def test_single_rank_budget_and_backoff() -> None:
    assert restart_delay([], 100.0, 3, 60.0) == (0.5, [])
    assert restart_delay([50.0, 90.0], 100.0, 3, 60.0) == (2.0, [50.0, 90.0])
    assert restart_delay([41.0, 50.0, 90.0], 100.0, 3, 60.0) == (None, [41.0, 50.0, 90.0])
    assert restart_delay([39.0, 50.0, 90.0], 100.0, 3, 60.0) == (2.0, [50.0, 90.0]), "old restarts are free"


class _Node:
    def __init__(self, state: State) -> None:
        self.state = state


def test_chats_to_a_failed_instance_fail_fast_with_what_to_do() -> None:
    single = applied(
        InstanceCreated(instance=instance("a", ("n1",))),
        InstanceFailed(instance_id=A, failure_error="4 failures within 60 s"),
    )
    with pytest.raises(ApiError) as caught:
        require_instance(_Node(single), CARD.model_id)  # type: ignore[arg-type]
    assert caught.value.status == 503 and caught.value.code == "instance_failed"
    assert "DELETE /instance/a" in caught.value.message and "place it again" in caught.value.message
    command = StartChatCompletion(
        command_id=CommandId("c"), model=CARD.model_id,
    )
    events = events_for_command(single, command, TaskId("t"))
    assert isinstance(events[-1], TaskFailed) and "failed" in events[-1].error_message
    healthy = applied(InstanceCreated(instance=instance("b", ("n2",))), state=single)
    require_instance(_Node(healthy), CARD.model_id)  # type: ignore[arg-type]  # another instance may serve


def test_a_failed_instance_is_picked_only_when_nothing_else_is_left() -> None:
    state = applied(
        InstanceCreated(instance=instance("a", ("n1",))),
        InstanceFailed(instance_id=A, failure_error="gone"),
        InstanceCreated(instance=instance("b", ("n2",))),
    )
    assert pick_instance(state, CARD.model_id) == InstanceId("b"), "b is loading: it may still serve"
    assert pick_instance(applied(InstanceDeleted(instance_id=InstanceId("b")), state=state), CARD.model_id) == A
