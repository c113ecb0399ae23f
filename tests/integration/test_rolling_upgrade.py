"""A rolling upgrade (issue 44): two nodes of the previous release and one of this, then the old ones restarted
at this release one at a time, while an instance serves and clients stream through old and new nodes alike.

The previous release is commit 8f0fa60 (the last before format versions, types/versions.py), checked out into a
temporary git worktree and run with the same interpreter, its own `src` first on PYTHONPATH. Its nodes send no
version (version 1); this release speaks version 2, one apart, so the two must work together: every stream
either completes or ends with a retryable error, and the cluster serves at the end. The upgraded node finds its
old desired.json and event log and migrates them, keeping the version-1 files as `.v1.bak`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import skulk
from skulk.models.demo import DEMO_MODEL_ID
from skulk.testing.convergence import formed, why_not_formed
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import StreamLoop, StreamOutcome, StreamProbe, chat_body
from skulk.types import versions

from .harness import Cluster, place_and_wait, wait_until

PREVIOUS_RELEASE = "8f0fa60"
MODEL = str(DEMO_MODEL_ID)
REPO = Path(__file__).resolve().parents[2]
HEAD_SRC = Path(skulk.__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def previous_release(tmp_path: Path) -> Iterator[Path]:
    """The previous release's `src`, from a detached worktree removed again at the end."""
    if _git("cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}").returncode != 0:
        pytest.skip(f"the repository has no commit {PREVIOUS_RELEASE} (a shallow clone?): no previous release to run")
    where = tmp_path / "previous-release"
    added = _git("worktree", "add", "--detach", str(where), PREVIOUS_RELEASE)
    assert added.returncode == 0, added.stderr
    try:
        yield where / "src"
    finally:
        _git("worktree", "remove", "--force", str(where))
        _git("worktree", "prune")


def _at(src: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(src)}


def _upgrade(node: LocalNode, nodes: list[LocalNode]) -> None:
    """Stop the node, start it again from this release (same home, ports and peers), wait until all are one."""
    node.stop()
    node.extra_env = {**node.extra_env, **_at(HEAD_SRC)}
    node.restart().wait_ready()
    wait_until(lambda: formed(nodes), 60, "the cluster to form again after an upgrade", lambda: why_not_formed(nodes))


def _upgrade_while_streaming(upgrading: LocalNode, other: LocalNode, nodes: list[LocalNode]) -> list[StreamOutcome]:
    """Upgrade one node while a client streams through another (its API may be either release); the outcomes."""
    loop = StreamLoop(other.url, chat_body(MODEL, 24, temperature=0.0))
    try:
        wait_until(lambda: any(o.kind == "completed" for o in loop.outcomes), 60,
                   "a stream through the node not being upgraded")
        _upgrade(upgrading, nodes)
        upgraded = time.monotonic()
        wait_until(lambda: _completed_since(loop, upgraded), 60, "a stream started after the upgrade to complete",
                   lambda: str([o.describe() for o in loop.outcomes[-5:]]))
    finally:
        outcomes = loop.stop()
    return outcomes


def _completed_since(loop: StreamLoop, since: float) -> bool:
    return any(o.started > since and o.kind == "completed" for o in list(loop.outcomes))


def _acceptable(outcome: StreamOutcome) -> bool:
    return outcome.kind == "completed" or outcome.retryable_error


def _check_migrated(home: Path) -> None:
    desired = json.loads((home / "desired.json").read_text())
    assert desired["formatVersion"] == versions.FORMAT_VERSION
    assert "formatVersion" not in json.loads((home / "desired.json.v1.bak").read_text())
    first = (home / "eventlog" / "events.jsonl").open().readline()
    assert json.loads(first)["v"] == versions.FORMAT_VERSION
    assert (home / "eventlog" / "events.jsonl.v1.bak").exists()


@pytest.mark.timeout(240)
def test_two_old_nodes_and_one_new_then_upgraded_one_at_a_time_while_serving(
        cluster: Cluster, previous_release: Path) -> None:
    old_a = cluster.start(1, extra_env=_at(previous_release))[0]
    old_b = cluster.start(1, extra_env=_at(previous_release))[0]
    new = cluster.start(1, extra_env=_at(HEAD_SRC))[0]
    nodes = [old_a, old_b, new]
    try:
        wait_until(lambda: formed(nodes), 60, "a mixed-version cluster to form", lambda: why_not_formed(nodes))
        # the instance lives on the new node, so it serves through both upgrades; chunks cross versions to old APIs
        place_and_wait(new, MODEL, min_nodes=1, excluded_nodes=[old_a.node_id, old_b.node_id])
        first = StreamProbe(old_b.url, chat_body(MODEL, 8, temperature=0.0)).wait(60)
        assert first.kind == "completed", f"an old node's API streams from the new node's runner: {first.describe()}"
        through_new = StreamLoop(new.url, chat_body(MODEL, 24, temperature=0.0))
        outcomes: list[StreamOutcome] = []
        try:
            for upgrading, other in ((old_a, old_b), (old_b, old_a)):
                outcomes += _upgrade_while_streaming(upgrading, other, nodes)
        finally:
            outcomes += through_new.stop()
        assert any(o.kind == "completed" for o in outcomes[-3:]), "the new node's API served to the end"
        bad = [o.describe() for o in outcomes if not _acceptable(o)]
        assert not bad, f"streams that neither completed nor ended retryably: {bad}"
        for node in nodes:
            last = StreamProbe(node.url, chat_body(MODEL, 8, temperature=0.0)).wait(60)
            assert last.kind == "completed", f"after the upgrade: {last.describe()}"
        for node in (old_a, old_b):
            _check_migrated(node.home)
    finally:
        cluster.print_logs(30)
