"""What each runner of a placed instance holds in memory, against the shard it loaded (issue 41): shared by
tests/integration/test_runner_memory.py and bench/memory.py.

Resident memory is read from the runner process itself (/proc: VmRSS, VmHWM, RssAnon, RssFile; psutil's USS and
PSS), its shard's bytes from the checkpoint's safetensors headers (engines/footprint.py), with the layers
the placement gave that runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from skulk.engines.footprint import resident_bound, shard_bytes

from .cluster import instance_ready
from .nodes import LocalNode
from .waiting import wait_until


@dataclass(frozen=True)
class RankMemory:
    """One runner's figures, in bytes."""

    node_id: str
    start_layer: int
    end_layer: int
    shard: int
    rss: int
    peak: int
    anon: int
    file: int
    uss: int
    pss: int

    @property
    def ratio(self) -> float:
        return self.rss / self.shard

    @property
    def bound(self) -> int:
        return resident_bound(self.shard)

    def row(self) -> str:
        mib = 1024**2
        return (f"layers {self.start_layer:>2}-{self.end_layer - 1:<2} shard {self.shard / mib:7.1f} MiB  "
                f"rss {self.rss / mib:7.1f} (anon {self.anon / mib:6.1f} file {self.file / mib:6.1f})  "
                f"uss {self.uss / mib:7.1f}  peak {self.peak / mib:7.1f}  rss/shard {self.ratio:4.2f}  "
                f"bound {self.bound / mib:7.1f}{'' if self.rss <= self.bound else '  OVER'}")


def process_memory(pid: int) -> dict[str, int]:
    """rss, peak (VmHWM: the most it was ever resident), anon, file (RssAnon, RssFile), uss and pss, in bytes."""
    fields = {"VmRSS": "rss", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}
    found: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) * 1024
    full = psutil.Process(pid).memory_full_info()
    return {**found, "uss": int(full.uss), "pss": int(getattr(full, "pss", full.uss))}


def place_and_measure(api: LocalNode, nodes: list[LocalNode], model_id: str, *, quantization: str | None = None,
                      others: list[LocalNode] | None = None, kv_cache_gb: float = 0.05,
                      timeout: float = 180.0) -> tuple[str, list[RankMemory]]:
    """Place model_id on exactly `nodes` (Pipeline, torch engine; `others` excluded), wait until it is ready, and
    measure each runner: (instance id, one RankMemory per rank, in layer order). The caller deletes it."""
    body: dict[str, Any] = {"model_id": model_id, "sharding": "Pipeline", "engine": "torch",
                            "min_nodes": len(nodes), "kv_cache_gb": kv_cache_gb,
                            "excluded_nodes": [n.node_id for n in others or []]}
    if quantization:
        body["quantization"] = quantization
    status, reply = api.post("/place_instance", body, timeout=timeout)
    if status != 200:
        raise RuntimeError(f"placement refused ({status}): {reply}")
    instance_id = reply["instanceId"]
    assignments = next(iter(reply["instance"].values()))["shardAssignments"]
    by_node = {node: assignments["runnerToShard"][runner] for node, runner in assignments["nodeToRunner"].items()}
    if set(by_node) != {n.node_id for n in nodes}:
        raise RuntimeError(f"placed on {sorted(by_node)}, asked for {[n.node_id for n in nodes]}")
    wait_until(lambda: instance_ready(api, instance_id), timeout, f"instance {instance_id} to be ready")
    ranks = []
    for node in nodes:
        shard = next(iter(by_node[node.node_id].values()))
        start, end = int(shard["startLayer"]), int(shard["endLayer"])
        pids = node.runner_pids()
        if len(pids) != 1:
            raise RuntimeError(f"node {node.node_id} runs {len(pids)} runners, expected one")
        model_dir = node.home / "models" / model_id.replace("/", "--")
        figures = process_memory(pids.pop())
        ranks.append(RankMemory(node.node_id, start, end, shard_bytes(model_dir, start, end, quantization),
                                **figures))
    return instance_id, sorted(ranks, key=lambda r: r.start_layer)


def delete_instance(api: LocalNode, instance_id: str, nodes: list[LocalNode], timeout: float = 60.0) -> None:
    """Delete the instance and wait until its runners have exited."""
    with api.client() as client:
        client.delete(f"/instance/{instance_id}").raise_for_status()
    wait_until(lambda: not any(n.runner_pids() for n in nodes), timeout, "the instance's runners to exit")
