"""A silent stream on a busy instance is queued, not dead (issue 43): `decide` is a table, `next_chunk` its shell."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from skulk.api import patience as patience_module
from skulk.api.patience import decide, next_chunk, place_in_queue
from skulk.api.requests import Requests, Silent, stream_error
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport
from skulk.types.chunks import TokenChunk
from skulk.types.errors import ErrorCode
from skulk.types.events import InstanceCreated, RunnerStatusUpdated, TaskCreated, TaskStatusUpdated
from skulk.types.ids import CommandId, NodeId, RunnerId, TaskId
from skulk.types.runners import RunnerLoading, RunnerReady
from skulk.types.state import State
from skulk.types.tasks import TaskStatus
from skulk.types.waiting import GiveUp, KeepWaiting, Patience, WaitFacts, WaitingOn

from .factories import QuietTransport, applied, chat_task, instance

P = Patience(silence_s=120.0, queued_s=900.0, recheck_s=15.0)
PATIENCE = Patience(silence_s=0.05, queued_s=30.0, recheck_s=0.02)
"""The shell's tests: short slices, so a test that waits past the silence bound takes a fraction of a second."""


def facts(waited: float, *, assigned: bool = True, serving: bool = True, heard: float | None = None,
          ahead: int = 0, moved: bool = False) -> WaitFacts:
    return WaitFacts(waited_s=waited, assigned=assigned, serving=serving, heard_ago_s=heard, ahead=ahead,
                     queue_moved=moved)


CASES: list[tuple[str, WaitFacts, KeepWaiting | GiveUp]] = [
    ("others heard a second ago: queued, wait on", facts(120, heard=1, ahead=40),
     KeepWaiting(15.0, WaitingOn.queue)),
    ("the queue moved though none of this node's streams heard: wait on", facts(120, ahead=3, moved=True),
     KeepWaiting(15.0, WaitingOn.queue)),
    ("queued up to the long bound, then it ends naming the queue", facts(900, heard=1, ahead=7),
     GiveUp(WaitingOn.queue, 900)),
    ("a queued wait looks again no later than the bound", facts(895, heard=1), KeepWaiting(5.0, WaitingOn.queue)),
    ("nobody heard anything for the silence bound: the runner is silent", facts(120, heard=None),
     GiveUp(WaitingOn.silent_runner, 120)),
    ("others last heard long ago: silent", facts(200, heard=130), GiveUp(WaitingOn.silent_runner, 130)),
    ("the instance went quiet lately after serving others: wait out its silence", facts(300, heard=121),
     GiveUp(WaitingOn.silent_runner, 121)),
    ("still loading: the short bound", facts(120, serving=False, heard=1), GiveUp(WaitingOn.loading, 120)),
    ("loading, not yet long: wait on", facts(60, serving=False), KeepWaiting(15.0, WaitingOn.loading)),
    ("no task yet: unassigned", facts(120, assigned=False), GiveUp(WaitingOn.unassigned, 120)),
]


@pytest.mark.parametrize(("why", "given", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decide(why: str, given: WaitFacts, expected: KeepWaiting | GiveUp) -> None:
    assert decide(given, P) == expected


MESSAGES: list[tuple[str, Silent, ErrorCode, str]] = [
    ("queued", Silent("m", True, 900, WaitingOn.queue, 12), ErrorCode.timeout,
     "the request waited 900 s queued behind 12 requests on the instance for m, which is serving them; retry later"),
    ("loading", Silent("m", True, 120, WaitingOn.loading), ErrorCode.instance_not_ready,
     "the instance for m is still loading after 120 s; retry shortly"),
    ("unassigned", Silent("m", True, 120, WaitingOn.unassigned), ErrorCode.instance_not_ready,
     "no instance of m took the request in 120 s; retry shortly"),
    ("silent first", Silent("m", True, 120), ErrorCode.instance_not_ready,
     "the instance for m reports ready but produced nothing for any request in 120 s; retry shortly"),
    ("silent next", Silent("m", False, 300), ErrorCode.timeout,
     "no token for 300 s and the instance for m produced nothing for any request; retry the request"),
]


@pytest.mark.parametrize(("why", "silent", "code", "message"), MESSAGES, ids=[c[0] for c in MESSAGES])
def test_a_silence_names_what_it_waited_for(why: str, silent: Silent, code: ErrorCode, message: str) -> None:
    error = stream_error(State(), silent, CommandId("c"))
    assert error is not None and (error.code, error.message) == (code, message)


def _serving(*tasks: tuple[str, str], ready: bool = True) -> State:
    status = RunnerReady() if ready else RunnerLoading()
    return applied(InstanceCreated(instance=instance()),
                   RunnerStatusUpdated(runner_id=RunnerId("r-n1"), runner_status=status),
                   *(TaskCreated(task=chat_task(t, command_id=c)) for t, c in tasks))


def test_place_in_queue_counts_the_open_older_tasks_of_the_same_instance() -> None:
    state = _serving(("t1", "c1"), ("t2", "c2"), ("t3", "c3"))
    state = applied(TaskStatusUpdated(task_id=TaskId("t1"), task_status=TaskStatus.Complete), state=state)
    assert place_in_queue(state, CommandId("c3")) == ("inst", 1)
    assert place_in_queue(state, CommandId("nope")) == (None, 0)


def _requests() -> Requests:
    quiet = cast(Transport, QuietTransport())
    return Requests(quiet, PayloadBook(quiet, NodeId("n1")), lambda _: None)


async def test_no_503_while_the_instance_serves_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request waits past the silence bound, look after look, while its neighbour streams (a chunk reaches the
    neighbour just before each look: no wall clock decides it), then gets its own token."""
    state = _serving(("t1", "busy"), ("t2", "mine"))
    requests = _requests()
    requests.open(CommandId("busy"))
    mine = requests.open(CommandId("mine"))
    looks: list[WaitingOn] = []
    real_gather = patience_module.gather

    def gather(*args: Any) -> WaitFacts:
        requests.deliver(TokenChunk(command_id=CommandId("busy"), token_id=1, text="x"))
        facts = real_gather(*args)
        looks.append(patience_module.waiting_on(facts, PATIENCE))
        if len(looks) == 5:
            requests.deliver(TokenChunk(command_id=CommandId("mine"), token_id=2, text="at last"))
        return facts

    monkeypatch.setattr(patience_module, "gather", gather)
    got = await asyncio.wait_for(next_chunk(lambda: state, requests, mine, "m", first=True, patience=PATIENCE), 10)
    assert isinstance(got, TokenChunk) and got.text == "at last"
    assert looks == [WaitingOn.queue] * 5


@pytest.mark.parametrize(("ready", "on"), [(True, WaitingOn.silent_runner), (False, WaitingOn.loading)],
                         ids=["ready", "loading"])
async def test_a_silent_instance_still_ends_the_wait(ready: bool, on: WaitingOn) -> None:
    state = _serving(("t1", "mine"), ready=ready)
    requests = _requests()
    mine = requests.open(CommandId("mine"))
    got = await asyncio.wait_for(next_chunk(lambda: state, requests, mine, "m", first=True, patience=PATIENCE), 10)
    assert isinstance(got, Silent) and got.on is on and got.waited_s >= 0.05
