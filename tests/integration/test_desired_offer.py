"""Another node's good copy of the desired state wins over a corrupt local one, whichever node is elected first
(issue 38): three real nodes with an operator's MetaInstance, all stopped, one node's desired.json replaced by
garbage, then restarted (a) with the corrupt node first, so it is the first master, (b) with a good node first.

In both orders the operator's MetaInstance comes back (and only it: the corrupt master, started with
--place-default, does not add the default one beside it), the garbage is kept aside, and no good node's file is
ever seen without the MetaInstance while the cluster restarts. The MetaInstance asks for a 64 TiB KV cache, so
it is never placed: nothing here starts a runner."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from skulk.testing.nodes import LocalNode

from .harness import Cluster, wait_until

MODEL = "skulk/tiny-random-llama"
GARBAGE = b"\x00\xff{ not json at all"
pytestmark = pytest.mark.timeout(300)


class FileWatch:
    """Reads the good nodes' desired.json every 20 ms while the cluster restarts: a version without the
    MetaInstance, even for a moment, is a good file overwritten with less."""

    def __init__(self, nodes: list[LocalNode], meta_id: str) -> None:
        self.paths, self.meta_id = [n.home / "desired.json" for n in nodes], meta_id
        self.lost: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> FileWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            for path in self.paths:
                text = path.read_text()  # written by rename: always one whole version
                if self.meta_id not in json.loads(text).get("metaInstances", {}):
                    self.lost.append(f"{path}: {text[:200]}")


def saved_metas(node: LocalNode) -> list[str]:
    try:
        return list(json.loads((node.home / "desired.json").read_text()).get("metaInstances", {}))
    except (OSError, ValueError):
        return []


def metas(node: LocalNode) -> list[str]:
    return list((node.get("/state", timeout=10) or {}).get("metaInstances", {}))


@pytest.fixture(scope="module")
def formed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[LocalNode], str]]:
    cluster = Cluster(tmp_path_factory.mktemp("desired"))
    try:
        nodes = cluster.form(3)
        status, reply = nodes[1].post("/meta_instance", {"model_id": MODEL, "kv_cache_gb": 65536})
        assert status == 200, reply
        meta_id = reply["meta_instance_id"]
        wait_until(lambda: all(saved_metas(n) == [meta_id] for n in nodes), 30, "every node to save it")
        yield cluster, nodes, meta_id
    finally:
        assert cluster.stop_all() == [], "runner processes outlived their node"


def restart_with_one_corrupt(cluster: Cluster, nodes: list[LocalNode], meta_id: str, corrupt: LocalNode,
                             first: LocalNode) -> None:
    """Stop all, garble `corrupt`'s file, start `first` alone (it is elected master), then the others."""
    for node in nodes:
        node.stop()
    (corrupt.home / "desired.json").write_bytes(GARBAGE)
    good = [n for n in nodes if n is not corrupt]
    with FileWatch(good, meta_id) as watch:
        first.restart(place_default=first is corrupt).wait_ready()
        assert cluster.master([first]) is first
        rest = [n.restart() for n in nodes if n is not first]
        for node in rest:
            node.wait_ready()
        wait_until(lambda: all(metas(n) == [meta_id] for n in nodes), 60, "the operator's MetaInstance back",
                   lambda: cluster.print_logs(30) or "")
        wait_until(lambda: all(saved_metas(n) == [meta_id] for n in nodes), 30, "every node to save it again")
    assert watch.lost == [], f"a good file was overwritten with less: {watch.lost[:3]}"
    asides = list(corrupt.home.glob("desired.json.corrupt-*"))
    assert [p.read_bytes() for p in asides[-1:]] == [GARBAGE], "the corrupt file kept aside"
    assert all(metas(n) == [meta_id] for n in nodes), "no default MetaInstance added beside the operator's"
    for path in asides:
        path.unlink()


def test_the_corrupt_node_elected_first_restores_a_followers_copy(
        formed: tuple[Cluster, list[LocalNode], str]) -> None:
    cluster, nodes, meta_id = formed
    restart_with_one_corrupt(cluster, nodes, meta_id, corrupt=nodes[0], first=nodes[0])


def test_a_good_node_elected_first_restores_its_own_over_the_corrupt_one(
        formed: tuple[Cluster, list[LocalNode], str]) -> None:
    cluster, nodes, meta_id = formed
    restart_with_one_corrupt(cluster, nodes, meta_id, corrupt=nodes[2], first=nodes[0])
