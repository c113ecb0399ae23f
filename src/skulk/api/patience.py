"""How long a request waits for its next chunk, and what it says when it stops waiting.

A stream that hears nothing is not necessarily dead: on a busy instance it is queued behind others (or preempted
while the KV pool is short), and ending it with "the instance produced nothing" while that instance streams to
63 others is a lie (issue 43). So a silence is judged, by `decide`, from what this node knows: whether an
instance has the request yet, whether its runners are ready, when any stream of that instance last heard a chunk,
and whether the requests ahead of it are finishing. A request on an instance that serves others keeps waiting, up
to `Patience.queued_s`; one whose instance produced nothing for anyone for `silence_s` (or is still loading)
ends, and its error names what it waited for. `next_chunk` is the thin shell that gathers those facts."""

from __future__ import annotations

import time
from collections.abc import Callable

from skulk.api.requests import FIRST_CHUNK_TIMEOUT_S, NEXT_CHUNK_TIMEOUT_S, QUEUED_TIMEOUT_S, Requests, Silent
from skulk.cluster.dataplane import ChunkStream
from skulk.state.queries import is_serving
from skulk.types.chunks import Chunk
from skulk.types.ids import CommandId, InstanceId
from skulk.types.state import State
from skulk.types.tasks import Task, TaskStatus
from skulk.types.waiting import GiveUp, KeepWaiting, Patience, WaitFacts, WaitingOn

RECHECK_S = 15.0
"""How often a request that waits behind others looks again."""
FIRST = Patience(silence_s=FIRST_CHUNK_TIMEOUT_S, queued_s=QUEUED_TIMEOUT_S, recheck_s=RECHECK_S)
NEXT = Patience(silence_s=NEXT_CHUNK_TIMEOUT_S, queued_s=QUEUED_TIMEOUT_S, recheck_s=RECHECK_S)


def waiting_on(facts: WaitFacts, patience: Patience) -> WaitingOn:
    """Pure: what a silent request waits for. The instance is alive when it finished a request ahead of this
    one since the last look, or any of its streams heard a chunk within `silence_s`."""
    if not facts.assigned:
        return WaitingOn.unassigned
    if not facts.serving:
        return WaitingOn.loading
    heard = facts.heard_ago_s is not None and facts.heard_ago_s < patience.silence_s
    return WaitingOn.queue if facts.queue_moved or heard else WaitingOn.silent_runner


def held_on(state: State, task: Task | None) -> WaitingOn | None:
    """Pure: what a request this node's API holds waits for before a runner has it, as GET /metrics counts it at
    scrape time (one look at the state, no history: a queue is not told from a silent runner here). No task yet,
    or its instance gone: unassigned; its instance not serving: loading; pending on a serving instance: queue (the
    runner has not accepted it). None once a runner accepted it (Running) or it ended (the API closes it next)."""
    if task is None:
        return WaitingOn.unassigned
    if task.task_status is not TaskStatus.Pending:
        return None
    instance = state.instances.get(task.instance_id)
    if instance is None:
        return WaitingOn.unassigned
    return WaitingOn.queue if is_serving(state, instance) else WaitingOn.loading


def decide(facts: WaitFacts, patience: Patience) -> KeepWaiting | GiveUp:
    """Pure: wait on (for how long before looking again) or give up, and on what. A queued request's bound is
    `queued_s` of its own wait; a silent instance's is `silence_s` of the instance's silence (what it last did
    for anyone, not how long this request happened to queue before)."""
    on = waiting_on(facts, patience)
    if on is WaitingOn.queue:
        silent, bound = facts.waited_s, patience.queued_s
    elif on is WaitingOn.silent_runner and facts.heard_ago_s is not None:
        silent, bound = min(facts.waited_s, facts.heard_ago_s), patience.silence_s
    else:
        silent, bound = facts.waited_s, patience.silence_s
    if silent >= bound:
        return GiveUp(on, silent)
    return KeepWaiting(min(patience.recheck_s, bound - silent), on)


def place_in_queue(state: State, command_id: CommandId) -> tuple[InstanceId | None, int]:
    """The instance whose task runs `command_id` (None: no task yet) and how many open tasks on it are older."""
    ahead = 0
    for task in state.tasks.values():  # insertion order: the order the master created them
        if task.command_id == command_id:
            older = [t for t in state.tasks.values() if t.instance_id == task.instance_id]
            ahead = sum(1 for t in older[:older.index(task)] if t.task_status.is_open)
            return task.instance_id, ahead
    return None, ahead


def gather(state: State, requests: Requests, command_id: CommandId, waited_s: float,
           ahead_before: int | None) -> WaitFacts:
    """The facts `decide` reads, from this node's state and its open streams."""
    instance_id, ahead = place_in_queue(state, command_id)
    instance = state.instances.get(instance_id) if instance_id is not None else None
    return WaitFacts(waited_s=waited_s, assigned=instance is not None,
                     serving=instance is not None and is_serving(state, instance),
                     heard_ago_s=requests.heard_ago(state, instance_id) if instance_id is not None else None,
                     ahead=ahead, queue_moved=ahead_before is not None and ahead < ahead_before)


async def next_chunk(state_of: Callable[[], State], requests: Requests, stream: ChunkStream, model: str, *,
                     first: bool, patience: Patience | None = None) -> Chunk | Silent:
    """The stream's next chunk, or the Silent that ends it (what it waited for, and for how long)."""
    patience = patience or (FIRST if first else NEXT)
    started = time.monotonic()
    slice_s, ahead_before = patience.silence_s, None
    while True:
        try:
            return await stream.next(slice_s)
        except TimeoutError:
            pass
        facts = gather(state_of(), requests, stream.command_id, time.monotonic() - started, ahead_before)
        verdict = decide(facts, patience)
        if isinstance(verdict, GiveUp):
            return Silent(model=model, first=first, waited_s=verdict.silent_s, on=verdict.on, ahead=facts.ahead)
        slice_s, ahead_before = verdict.for_s, facts.ahead
