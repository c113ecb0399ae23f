"""Faults inflicted on real nodes, and a watch over what the cluster reports meanwhile.

A fault is the test's own action (a pause of fixed length is the fault itself, not a wait); everything the
cluster does in response is observed by polling each node's /state on a background thread, so a test can
ask afterwards whether two masters ever coexisted, or when the survivors first agreed on a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .convergence import Reporter, assert_converged, state_of, view_of
from .nodes import LocalNode
from .streams import StreamOutcome


@contextmanager
def frozen(node: LocalNode) -> Iterator[float]:
    """SIGSTOP the node's process group for the block, and always SIGCONT it, even when the block fails.

    Yields the monotonic time the pause began."""
    node.pause()
    try:
        yield time.monotonic()
    finally:
        node.resume()


def pause_for(node: LocalNode, seconds: float) -> float:
    """Freeze the node for `seconds` (the fault's duration), then thaw it; returns the time it resumed."""
    with frozen(node):
        time.sleep(seconds)
    return time.monotonic()


@dataclass(frozen=True)
class Sample:
    """One node's answer at one moment: who it names master, and whether it answered at all."""

    at: float
    node: str
    answered: bool
    master: str | None
    term: int


class Watch:
    """Polls every node's view on background threads and keeps the samples, for after-the-fact questions.

    One thread per node: a frozen node's API hangs until its timeout, which must not blind the watch to the
    others. Nodes are identified by their index in the list given, since a restarted node changes its id."""

    def __init__(self, nodes: Sequence[Reporter], poll: float = 0.1) -> None:
        self.nodes = nodes
        self.poll = poll
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(nodes))]

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _run(self, index: int) -> None:
        node = self.nodes[index]
        while not self._stop.is_set():
            view = view_of(node)
            master, term = (view.master, view.term) if view is not None else (None, 0)
            with self._lock:
                self.samples.append(Sample(time.monotonic(), f"node{index}", view is not None, master, term))
            self._stop.wait(self.poll)

    def _sorted(self) -> list[Sample]:
        with self._lock:
            return sorted(self.samples, key=lambda s: s.at)

    def of(self, index: int, since: float = 0.0) -> list[Sample]:
        return [s for s in self._sorted() if s.node == f"node{index}" and s.at >= since and s.answered]

    def masters_named(self, index: int, since: float = 0.0) -> set[str | None]:
        """Every master node `index` named since `since` (None: it named none for a while)."""
        return {s.master for s in self.of(index, since)}

    def changes(self, index: int, since: float) -> list[str]:
        """When node `index` changed the master it names, in seconds after `since`: a failure's timeline."""
        found, last = [], "unset"
        for sample in self.of(index, since):
            if sample.master != last:
                found.append(f"+{sample.at - since:.1f}s {str(sample.master)[:8]} (term {sample.term})")
                last = sample.master
        return found

    def first(self, predicate: Callable[[dict[int, Sample]], bool], since: float = 0.0) -> float | None:
        """The first time the latest samples of all nodes satisfied `predicate` (keyed by node index)."""
        latest: dict[int, Sample] = {}
        for sample in self._sorted():
            if sample.at < since or not sample.answered:
                continue
            latest[int(sample.node[4:])] = sample
            if predicate(latest):
                return sample.at
        return None

    def split_brain(self, indices: list[int], since: float = 0.0) -> list[str]:
        """Moments when the given nodes, each answering, named two different masters at once.

        Latest-sample comparison: a handover seen a poll apart on two nodes is not counted, a lasting
        disagreement (more than two polls) is."""
        findings = []
        latest: dict[int, Sample] = {}
        for sample in self._sorted():
            index = int(sample.node[4:])
            if sample.at < since or index not in indices or not sample.answered:
                continue
            latest[index] = sample
            named = {s.master for s in latest.values() if s.at > sample.at - 2.5 * self.poll and s.master}
            if len(named) > 1:
                findings.append(f"t={sample.at:.1f}: {sorted(str(m)[:8] for m in named)}")
        return findings


def instance_members(state: dict[str, Any], instance_id: str) -> tuple[set[str], set[str]]:
    """(node ids, runner ids) of an instance in a /state document; empty sets if it is gone."""
    wrapped = state.get("instances", {}).get(instance_id)
    if not wrapped:
        return set(), set()
    assignments = next(iter(wrapped.values()))["shardAssignments"]
    return set(assignments["nodeToRunner"]), set(assignments["runnerToShard"])


def labels(nodes: Sequence[LocalNode]) -> str:
    """node0(abcd1234) master ... : which index is which id, for failure messages."""
    return ", ".join(f"node{i}={n.node_id[:8]}" for i, n in enumerate(nodes))


class Verdicts:
    """Every clause of the contract checked and reported together: one failing clause must not hide another
    (a stream error and a lost instance after the same pause are two bugs, not one)."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def expect(self, ok: object, clause: str) -> bool:
        if not ok:
            self.failed.append(clause)
        return bool(ok)

    def settle(self) -> None:
        assert not self.failed, "contract broken:\n- " + "\n- ".join(self.failed)


def instance_ids(node: Reporter) -> set[str]:
    state = state_of(node)
    return set(state["instances"]) if state else set()


def runner_pids(nodes: Sequence[LocalNode]) -> dict[str, set[int]]:
    """Each node's live runner processes: the same pids later mean no runner was restarted meanwhile."""
    return {n.node_id: n.runner_pids() for n in nodes}


def check_instance_intact(
    verdicts: Verdicts, nodes: Sequence[LocalNode], instance_id: str, members: set[str], pids: dict[str, set[int]]
) -> None:
    """The instance is still there on every node, on the same nodes, served by the very same runner processes."""
    for index, node in enumerate(nodes):
        state = state_of(node) or {}
        now_there = sorted(state.get("instances", {}))
        verdicts.expect(
            instance_members(state, instance_id)[0] == members,
            f"instance {instance_id[:8]} torn down or moved as seen by node{index}: instances now {now_there}",
        )
    now = runner_pids([n for n in nodes if n.node_id in members])
    verdicts.expect(now == pids, f"runner processes replaced: {pids} -> {now}")


def check_all_completed(verdicts: Verdicts, outcomes: list[StreamOutcome]) -> None:
    bad = [o.describe() for o in outcomes if o.kind != "completed"]
    verdicts.expect(outcomes and not bad, f"{len(bad)} of {len(outcomes)} streams did not complete: {bad}")


def check_streams_ended(verdicts: Verdicts, outcomes: list[StreamOutcome], fault_at: float, bound: float) -> None:
    """Each stream completed or ended with one retryable error event, and every one open at `fault_at`
    had ended within `bound` seconds of it: no client is left hanging on a fault."""
    bad = [o.describe() for o in outcomes if o.kind != "completed" and not o.retryable_error]
    verdicts.expect(not bad, f"streams ended neither completed nor with a retryable error: {bad}")
    late = [
        f"{o.describe()} ended +{(o.ended or time.monotonic()) - fault_at:.1f}s"
        for o in outcomes
        if o.started <= fault_at and (o.ended is None or o.ended > fault_at + bound)
    ]
    verdicts.expect(not late, f"streams open at the fault ended more than {bound:.0f} s after it: {late}")


def check_converged(verdicts: Verdicts, nodes: Sequence[Reporter], timeout: float = 10.0) -> float | None:
    """assert_converged as a verdict; returns the seconds it took, or None if the nodes never agreed."""
    try:
        return assert_converged(nodes, timeout)
    except AssertionError as exc:
        verdicts.expect(False, str(exc))
        return None
