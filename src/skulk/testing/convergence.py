"""Do the nodes of a cluster agree? Read from each node's GET /state, for tests and benchmarks.

After a fault heals, the issue's contract is that every node reports the same master, term, last applied
event index and instances. A node that is down, frozen or unreachable has no view, which counts as
disagreement: convergence is about every node given, not a quorum of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .waiting import wait_until

FIELDS = ("masterNodeId", "term", "lastEventAppliedIdx", "instances")
"""The wire (camelCase) names in skulk.types.state.State that convergence compares."""


class Reporter(Protocol):
    """A node whose API can be read: LocalNode on loopback, NsNode inside a network namespace."""

    node_id: str

    def get(self, path: str, timeout: float = 5.0) -> Any: ...


@dataclass(frozen=True)
class View:
    """What one node reports about the cluster: the fields convergence compares."""

    master: str | None
    term: int
    idx: int
    instances: frozenset[str]

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(FIELDS, (self.master, self.term, self.idx, sorted(self.instances)), strict=True))


def state_of(node: Reporter) -> dict[str, Any] | None:
    return node.get("/state")


def master_of(node: Reporter) -> str | None:
    state = state_of(node)
    return None if state is None else state.get("masterNodeId")


def view_of(node: Reporter) -> View | None:
    """The node's view, or None while it cannot answer."""
    state = state_of(node)
    if state is None:
        return None
    return View(
        state.get("masterNodeId"),
        state.get("term", 0),
        state.get("lastEventAppliedIdx", -1),
        frozenset(state.get("instances", {})),
    )


def _label(node: Reporter, index: int) -> str:
    return f"node{index}({node.node_id[:8] or '?'})"


def converged(nodes: Sequence[Reporter]) -> tuple[bool, str]:
    """(True, summary) when every node answers with the same view and that master is one of them.

    Otherwise (False, details): each field on which the nodes differ, with every node's value, so a failure
    says at a glance which node is behind or following someone else."""
    views = {_label(n, i): view_of(n) for i, n in enumerate(nodes)}
    silent = [label for label, view in views.items() if view is None]
    answered = {label: view.as_dict() for label, view in views.items() if view is not None}
    problems = [f"no answer from {', '.join(silent)}"] if silent else []
    for name in FIELDS:
        values = {label: view[name] for label, view in answered.items()}
        if len({repr(v) for v in values.values()}) > 1:
            problems.append(f"{name} differs: " + "; ".join(f"{k}={v}" for k, v in values.items()))
    masters = {view.master for view in views.values() if view is not None}
    ids = {n.node_id for n in nodes}
    if not problems and not masters <= ids:
        problems.append(f"they agree on master {masters}, which is none of them ({sorted(ids)})")
    if problems:
        return False, "\n".join(problems)
    return True, f"agreed: {next(iter(answered.values()))}"


def assert_converged(nodes: Sequence[Reporter], timeout: float = 10.0, poll: float = 0.2) -> float:
    """Wait up to `timeout` for converged(nodes); fail listing the fields that still differ.

    Returns the seconds it took, which benchmarks report."""
    started = time.monotonic()
    what = f"{len(nodes)} nodes to converge"
    wait_until(lambda: converged(nodes)[0], timeout, what, lambda: converged(nodes)[1], poll=poll)
    return time.monotonic() - started


def one_master(nodes: Sequence[Reporter]) -> str | None:
    """The master every answering node names, if they name exactly one (None while they disagree)."""
    masters = {view.master for n in nodes if (view := view_of(n)) is not None}
    return next(iter(masters)) if len(masters) == 1 else None


def formed(nodes: Sequence[Reporter]) -> bool:
    """Every node knows every node and every directed link between them, and all name one master among them.

    Stronger than converged(): placement across nodes needs the topology links, not only agreement."""
    if not all(n.node_id for n in nodes):
        return False
    states = [state_of(n) for n in nodes]
    ids = {n.node_id for n in nodes}
    links = len(ids) * (len(ids) - 1)
    return (
        all(s is not None for s in states)
        and all(set(s["nodeMemory"]) == ids and len(s["topology"]["connections"]) == links for s in states if s)
        and one_master(nodes) in ids
    )


def why_not_formed(nodes: Sequence[Reporter]) -> str:
    """What each node knows that formed() compares: its nodes, its directed links and its master."""
    lines = [converged(nodes)[1]]
    for i, node in enumerate(nodes):
        state = state_of(node)
        if state is None:
            lines.append(f"{_label(node, i)}: no answer")
            continue
        links = sorted(f"{c['source'][:8]}->{c['sink'][:8]}" for c in state["topology"]["connections"])
        lines.append(f"{_label(node, i)}: nodeMemory {sorted(k[:8] for k in state['nodeMemory'])}, links {links}")
    return "\n".join(lines)
