"""The torch engine's Scheduler without a model: admission within the pools, prefix sharing, preemption, release,
the step's kind and chunk, and a follower that applies rank 0's headers reaching rank 0's state exactly.

Records here are plain (`Rec`); a step's computation is simulated on the bookkeeping alone (`compute`): a prefill
chunk shared in row order, one position per decoding row, a token sampled where the engine samples one."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pytest

from skulk.engines.torch.blocks import BlockAllocator, blocks_for
from skulk.engines.torch.header import MAX_ADMITS, Header, NewRequest, Preempt, Release, StepKind, WireError
from skulk.engines.torch.schedule import share_chunk
from skulk.engines.torch.scheduler import BlockCopy, Scheduled, Scheduler, StepPlan
from skulk.types.chat import SamplingParams

pytestmark = pytest.mark.timeout(60)


@dataclass(eq=False)
class Rec:
    """A request's bookkeeping only (the engine's Request carries sampling state beside it)."""

    request_id: str
    prompt: list[int]
    max_tokens: int = 4
    length: int = 0
    table: list[int] = field(default_factory=list)
    local: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    draft_len: int = 0
    spans: tuple[tuple[int, int], ...] = ()

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        return [*self.prompt, *self.emitted][start:end]


def make(add: NewRequest) -> Rec:
    return Rec(add.request_id, list(add.prompt), add.sampling.max_tokens)


def new(request_id: str, prompt: list[int], max_tokens: int = 4) -> NewRequest:
    return NewRequest(request_id, "", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def scheduler(blocks: int, *, size: int = 4, batch: int = 8, chunk: int = 64, leads: bool = True,
              local: int = 0, local_window: int = 0, window: int = 0) -> Scheduler[Rec]:
    return Scheduler(BlockAllocator(blocks, size), BlockAllocator(local, size) if local else None, max_batch=batch,
                     prefill_chunk=chunk, window=window, local_window=local_window, leads=leads)


def lead(s: Scheduler[Rec], adds: Sequence[NewRequest] = (), releases: Sequence[Release] = (),
         chunk: int = 64) -> Scheduled[Rec]:
    """Rank 0's step: the changes applied, then scheduled with a plain plan (every decoding row, `chunk`)."""
    changes = Header(StepKind.HEARTBEAT, tuple(adds), tuple(releases))
    s.apply(changes, make)
    return s.schedule(changes, lambda: StepPlan(any(r.length >= len(r.prompt) for r in s.running), chunk))


def follow(s: Scheduler[Rec], header: Header) -> Scheduled[Rec]:
    s.apply(header, make)
    return s.update(header)


def token(r: Rec) -> int:
    """The simulated sampler: a deterministic token per request and position."""
    return 1000 + (len(r.prompt) + len(r.emitted)) * 7 % 97


def compute(s: Scheduler[Rec], header: Header) -> None:
    """What the step does to the bookkeeping (step.py): decoding rows advance a position and sample; the chunk goes
    to the prompts being prefilled in row order, and a prompt it completes samples its first token."""
    start, end = header.rows or (0, len(s.running))
    decoding = [r for r in s.running[start:end] if r.length >= len(r.prompt)]
    prefilling = [r for r in s.running if r.length < len(r.prompt)]
    if header.kind in (StepKind.DECODE, StepKind.MIXED):
        for r in decoding:
            r.length += 1
            r.emitted.append(token(r))
    if header.kind in (StepKind.PREFILL, StepKind.MIXED):
        for r, take in zip(prefilling, share_chunk([len(r.prompt) - r.length for r in prefilling], header.chunk),
                           strict=True):
            r.length += take
            s.publish(r)
            if take and r.length == len(r.prompt):
                r.emitted.append(token(r))


def finished(s: Scheduler[Rec]) -> list[Release]:
    return [Release(r.request_id, cancelled=False) for r in s.running if len(r.emitted) >= r.max_tokens]


def ids(reqs: Iterable[Rec]) -> list[str]:
    return [r.request_id for r in reqs]


def test_the_scheduler_imports_no_torch() -> None:
    code = "import sys, skulk.engines.torch.scheduler\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50)
    assert out.stdout.strip() == "False"


# (pool blocks, max_batch, chunk, prompt lengths) -> requests admitted by the first step
ADMISSIONS = [
    (16, 8, 64, [7, 7], ["a", "b"]),  # room for both
    (3, 8, 64, [7, 7], ["a"]),  # b's prompt and first decode need 2 blocks; 1 is left: it waits
    (16, 1, 64, [3, 3], ["a"]),  # one row
    (16, 8, 4, [10, 3], ["a"]),  # a's 10 prompt tokens use the whole chunk: b waits for the next
    (16, 8, 64, [10, 3], ["a", "b"]),  # one chunk prefills both
    (4, 8, 64, [15, 1], ["a"]),  # a's 15 tokens and its first decode fill the 4 blocks: none left for b
    (64, 16, 64, [2] * 10, ["a", "b", "c", "d", "e", "f", "g", "h"]),  # MAX_ADMITS per header
    (2, 8, 64, [8, 1], []),  # FIFO: a does not fit, and b behind it never jumps the queue
]


@pytest.mark.parametrize(("pool", "batch", "chunk", "lengths", "admitted"), ADMISSIONS)
def test_admission_within_the_pool_rows_and_chunk(pool: int, batch: int, chunk: int, lengths: list[int],
                                                  admitted: list[str]) -> None:
    s = scheduler(pool, batch=batch)
    names = "abcdefghijklmnop"
    adds = [new(names[i], list(range(100 * i, 100 * i + n))) for i, n in enumerate(lengths)]
    done = lead(s, adds, chunk=chunk)
    assert ids(s.running) == admitted == ids(done.started)
    assert ids(s.pending) == [a.request_id for a in adds[len(admitted):]]
    assert len(done.header.admits) == len(admitted) <= MAX_ADMITS
    assert done.header.kind == (StepKind.PREFILL if admitted else StepKind.HEARTBEAT)
    for r in s.running:  # the whole prompt's blocks, and the first decode's where it starts a block
        assert len(r.table) == blocks_for(len(r.prompt), 4) == len(set(r.table))
    assert s.blocks.held == sum(len(r.table) for r in s.running) <= pool


# (first prompt, second prompt, block size) -> (blocks shared, tokens copied) by the second's admission
SHARING = [
    (list(range(22)), list(range(22)), 8, 2, 5),  # the same prompt: 2 whole blocks shared, 5 of the last copied
    (list(range(20)), list(range(20)), 8, 2, 0),  # only 3 of the last block to reuse: below min_copy, recomputed
    (list(range(20)), [*range(16), 99, 98], 8, 2, 0),  # 16 shared; the rest (1 token to reuse) recomputed
    (list(range(20)), [*range(12), 77, 78, 79, 80, 81], 8, 1, 4),  # one block, then 4 of the next copied
    (list(range(20)), [5, *range(1, 20)], 8, 0, 0),  # differs at the first token: nothing reused
]


@pytest.mark.parametrize(("first", "second", "size", "shared", "copied"), SHARING)
def test_a_prompt_reuses_the_cached_blocks_of_its_prefix(first: list[int], second: list[int], size: int,
                                                         shared: int, copied: int) -> None:
    s = scheduler(32, size=size)
    done = lead(s, [new("a", first)])
    compute(s, done.header)  # a's whole prompt: its full blocks are keyed
    done = lead(s, [new("b", second)], releases=[Release("a", cancelled=False)])
    assert ids(s.running) == ["b"]
    b = s.running[0]
    assert done.header.admits == (tuple(b.table[:shared]),)
    assert b.length == shared * size + copied
    if copied:
        source, took = done.header.copies[0]
        assert took == copied
        assert done.copies == [BlockCopy(source, b.table[shared])]
    else:
        assert done.header.copies == () and done.copies == []


def test_a_running_request_shares_its_prompt_blocks_with_a_later_one() -> None:
    """Ten chats with one system prompt hold it once: the second shares the first's full blocks while it runs."""
    s = scheduler(32, size=4)
    prompt = list(range(13))
    compute(s, lead(s, [new("a", prompt, max_tokens=50)]).header)
    done = lead(s, [new("b", prompt)])
    a, b = s.running
    assert b.table[:3] == a.table[:3] and done.header.admits == (tuple(a.table[:3]),)
    assert all(s.blocks.refcount(block) == 2 for block in a.table[:3])


def test_preemption_takes_the_latest_request_back_to_the_queue_with_its_tokens() -> None:
    s = scheduler(4, size=4)  # 16 positions
    compute(s, lead(s, [new("a", [1, 2, 3], 20), new("b", [4, 5, 6], 20)]).header)
    preempted: tuple[Preempt, ...] = ()
    for _ in range(12):
        done = lead(s)
        if done.header.preempts:
            preempted = done.header.preempts
            break
        compute(s, done.header)
    assert preempted and preempted[0].request_id == "b" and s.preemptions == 1
    assert ids(s.running) == ["a"] and ids(s.pending) == ["b"]
    b = s.pending[0]
    assert b.prompt == [4, 5, 6, *preempted[0].tokens] and b.length == 0 and b.table == [] and b.emitted == []
    assert s.blocks.held == len(s.running[0].table)


# (prompt tokens, tokens generated, leads) -> blocks kept cached at release
RELEASES = [
    (8, 1, True, 3),  # 8 + 1 positions hold tokens: 3 blocks of 4, every one cached
    (8, 1, False, 3),  # a follower keeps the same blocks (it keys none)
    (3, 1, True, 1),
    (16, 4, True, 5),
]


@pytest.mark.parametrize(("n", "generated", "leads", "cached"), RELEASES)
def test_release_frees_the_table_and_keeps_its_content_cached(n: int, generated: int, leads: bool,
                                                              cached: int) -> None:
    s = scheduler(16, leads=leads)
    compute(s, lead(s, [new("a", list(range(n)), max_tokens=generated + 5)]).header)
    for _ in range(generated):
        compute(s, lead(s).header)
    a = s.running[0]
    assert a.length == n + generated
    done = lead(s, releases=[Release("a", cancelled=True)])
    assert s.running == [] and a.table == [] and done.header.kind == StepKind.HEARTBEAT
    assert s.blocks.held == 0 and s.blocks.cached == cached
    assert s.release(Release("a", cancelled=True)).seq is None  # already gone: nothing to drop


def test_a_pending_request_is_released_from_the_queue() -> None:
    s = scheduler(2)
    lead(s, [new("a", list(range(7))), new("b", [1, 2])])
    assert ids(s.pending) == ["b"]
    dropped = s.release(Release("b", cancelled=True))
    assert dropped.seq is not None and not dropped.running and not s.pending


# (running rows: (prompt, length), chunk) -> (kind, chunk the header carries)
KINDS = [
    ([], 64, StepKind.HEARTBEAT, 0),
    ([(8, 8)], 64, StepKind.DECODE, 0),
    ([(8, 2)], 64, StepKind.PREFILL, 64),
    ([(8, 8), (8, 2)], 16, StepKind.MIXED, 16),
]


@pytest.mark.parametrize(("rows", "chunk", "kind", "carried"), KINDS)
def test_the_step_kind_and_chunk(rows: list[tuple[int, int]], chunk: int, kind: StepKind, carried: int) -> None:
    s = scheduler(32)
    for i, (n, length) in enumerate(rows):
        s.add(Rec(str(i), list(range(n))))
        s.admit(())
        s.running[-1].length = length
    done = s.schedule(Header(StepKind.HEARTBEAT),
                      lambda: StepPlan(any(r.length >= len(r.prompt) for r in s.running), chunk))
    assert (done.header.kind, done.header.chunk) == (kind, carried)


def state(s: Scheduler[Rec]) -> object:
    return ([(r.request_id, r.prompt, r.length, r.table, r.local) for r in s.pending],
            [(r.request_id, r.prompt, r.length, r.table, r.local, r.emitted) for r in s.running],
            s.blocks.available, s.blocks.held, s.local_blocks.available if s.local_blocks else None,
            s.preemptions)


CONFIGS = {  # (blocks, window, sliding pool's blocks, its window)
    "one pool": (12, 0, 0, 0),
    "small pool": (7, 0, 0, 0),
    "every layer slides": (12, 8, 0, 0),
    "hybrid": (16, 0, 10, 8),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_follower_applying_the_headers_reaches_the_same_state(config: str) -> None:
    """Rank 0 schedules a run of arrivals, shared prefixes, preemptions and releases; a follower applies each header
    to its own copy and computes the same steps: after every step both hold the same queue, rows and tables, and
    perform the same block copies."""
    blocks, window, local, local_window = CONFIGS[config]
    leader, follower = (scheduler(blocks, chunk=8, leads=leads, window=window, local=local, local_window=local_window)
                        for leads in (True, False))
    system = list(range(50, 61))
    arrivals = {0: [new("a", [*system, 1, 2], 6), new("b", [*system, 3], 9)], 2: [new("c", [*system, 1, 2], 5)],
                3: [new("d", list(range(9)), 7)], 6: [new("e", [*system, 4, 4, 4], 4)]}
    releases: list[Release] = []
    shared = 0
    for step in range(80):
        done = lead(leader, arrivals.get(step, []), releases, chunk=8)
        shared += sum(1 for blocks in done.header.admits if blocks)
        followed = follow(follower, done.header)
        assert followed.copies == done.copies
        assert ids(followed.started) == ids(done.started)
        for s in (leader, follower):
            compute(s, done.header)
        assert state(follower) == state(leader)
        releases = finished(leader)
        if step > 6 and not (leader.running or leader.pending or releases):
            break
    assert not leader.running and not leader.pending and leader.blocks.held == 0
    assert shared > 0  # the scenario shared prefixes
    assert (leader.preemptions > 0) == (config == "small pool")  # and, in the small pool, preempted


BAD_HEADERS = [
    (Header(StepKind.PREFILL, admits=((),)), "admits a request with 0 pending"),
    (Header(StepKind.DECODE, preempts=(Preempt("ghost"),)), "preempts 'ghost'"),
    (Header(StepKind.DECODE, rows=(0, 3)), "decodes rows"),
    (Header(StepKind.PREFILL, admits=((), ()), copies=((0, 0),)), "copies blocks for 1 of 2"),
]


@pytest.mark.parametrize(("header", "says"), BAD_HEADERS)
def test_a_follower_refuses_a_header_rank_0_could_not_have_sent(header: Header, says: str) -> None:
    with pytest.raises(WireError, match=says):
        scheduler(8, leads=False).update(header)


# (positions held, table blocks, positions the draft reaches, sliding pool) -> blocks taken (full, sliding)
RESERVES = [
    (5, 2, 6, False, (0, 0)),  # the draft stays in the last block
    (5, 2, 9, False, (1, 0)),  # it crosses into a third
    (5, 2, 17, True, (3, 5)),  # and five: the sliding table held none yet
]


@pytest.mark.parametrize(("length", "held", "positions", "hybrid", "taken"), RESERVES)
def test_a_speculative_step_reserves_the_blocks_its_draft_writes(length: int, held: int, positions: int,
                                                                 hybrid: bool, taken: tuple[int, int]) -> None:
    s = scheduler(16, local=8 if hybrid else 0, local_window=8 if hybrid else 0)
    r = Rec("a", list(range(length)), length=length, table=[s.blocks.allocate() for _ in range(held)])
    before = s.blocks.available, s.local_blocks.available if s.local_blocks else 0
    assert s.reserve(r, positions) == taken
    assert len(r.table) == max(held, blocks_for(positions, 4)) == held + taken[0]
    assert len(r.local) == taken[1]
    assert (s.blocks.available, s.local_blocks.available if s.local_blocks else 0) == (before[0] - taken[0],
                                                                                      before[1] - taken[1])


def test_a_preemption_waits_for_the_steps_in_flight() -> None:
    """Rank 0 of a Pipeline drains the steps in flight before it preempts (the victim's tokens must all be back, and
    a finished row may free blocks): the scheduler asks `drain` first, and preempts only once nothing is left."""
    s = scheduler(4, size=4)
    compute(s, lead(s, [new("a", [1, 2, 3], 20), new("b", [4, 5, 6], 20)]).header)
    while not s.short_of_blocks():
        compute(s, lead(s).header)
    asked: list[bool] = []

    def drain() -> bool:
        asked.append(len(asked) < 2)  # two steps in flight, then none
        return asked[-1]

    changes = Header(StepKind.HEARTBEAT)
    done = s.schedule(changes, lambda: StepPlan(True, 8), drain)
    assert asked == [True, True, False]
    assert [p.request_id for p in done.header.preempts] == ["b"]
