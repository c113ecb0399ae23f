"""Cost of the diagnostics: cluster fan-out latency, and what the flight recorder costs decode.

Starts real nodes on loopback (explicit zenoh endpoints, unique cluster names) and prints, from one run:
  latency (median, p95) of /v1/diagnostics/cluster and /v1/diagnostics/cluster/timeline
      with 3 nodes alive, with one peer frozen (SIGSTOP: alive but not answering, the case the per-peer
      timeout exists for; only the first call sees it, the cluster forgets it after its liveliness lease),
      and with that peer killed                      (target: bounded by the per-peer timeout, printed)
  decode tokens/s of one stream, flight recorder on ÷ recording off
      (2-rank Pipeline instances of the same model on two node sets, the second started with
      SKULK_FLIGHT_RECORDER=0; rounds interleaved so machine noise hits both alike)      (target >= 0.98)
  decode tokens/s, event log on ÷ off (the recorder-off set against a third 2-node set started with
      SKULK_FLIGHT_RECORDER=0 and SKULK_EVENT_LOG=0: the two sets differ only in the log)  (target >= 0.98)
  decode tokens/s, tracing on ÷ off (the same instance, PUT /v1/tracing flipped between
      interleaved rounds, so each traced request records spans on both ranks)            (target >= 0.95)

Run: .venv/bin/python bench/diagnostics.py [--model skulk/bench-random-100m] [--calls 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from skulk.diagnostics.cluster import DEFAULT_PEER_TIMEOUT_S
from skulk.models.cards import model_dir_name
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import decode_tokens_per_s
from skulk.testing.waiting import wait_until

PROMPT = "Explain how a distributed inference cluster finds the rank that is stuck."
PATHS = ("/v1/diagnostics/cluster", "/v1/diagnostics/cluster/timeline")


def start_set(root: Path, name: str, count: int, env: dict[str, str], model: str) -> list[LocalNode]:
    """`count` nodes of one cluster, each bootstrapped to the ones before it; the model is pre-linked into
    every home so four runners do not generate the same random weights four times."""
    cluster = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    nodes: list[LocalNode] = []
    for i in range(count):
        home = root / f"{name}{i}"
        link_model(root / "cache", home / "models", model)
        peers = [n.endpoint for n in nodes]
        nodes.append(LocalNode(home=home, cluster=cluster, peers=peers, extra_env=env).start())
    for node in nodes:
        node.wait_ready(120)
    wait_until(lambda: formed(nodes), 60, f"{name} nodes to form")
    return nodes


def link_model(cache: Path, models: Path, model: str) -> None:
    source = ensure_builtin_model(model, cache)
    target = models / model_dir_name(model)
    if not target.exists():
        models.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, target, copy_function=os.link)


def state(node: LocalNode) -> dict[str, Any]:
    return httpx.get(node.url + "/state", timeout=30, trust_env=False).json()


def formed(nodes: list[LocalNode]) -> bool:
    states = [state(n) for n in nodes]
    ids = {n.node_id for n in nodes}
    return all(set(s["nodeMemory"]) == ids for s in states) and len({s["masterNodeId"] for s in states}) == 1


def place(node: LocalNode, model: str, excluded: list[str]) -> str:
    """A 2-rank Pipeline instance, waited on until both runners are ready."""
    body = {"model_id": model, "min_nodes": 2, "sharding": "Pipeline", "excluded_nodes": excluded}
    reply = httpx.post(node.url + "/place_instance", json=body, timeout=120, trust_env=False)
    reply.raise_for_status()
    instance_id: str = reply.json()["instanceId"]

    def ready() -> bool:
        s = state(node)
        runners = s["instances"][instance_id]["MlxRingInstance"]["shardAssignments"]["runnerToShard"]
        return all("RunnerReady" in s["runners"].get(r, {}) for r in runners)

    wait_until(ready, 600, f"instance {instance_id} to be ready")
    return instance_id


def latencies(node: LocalNode, path: str, calls: int) -> list[float]:
    found = []
    with httpx.Client(base_url=node.url, timeout=60, trust_env=False) as client:
        for _ in range(calls):
            start = time.perf_counter()
            client.get(path).raise_for_status()
            found.append(time.perf_counter() - start)
    return found


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"median {statistics.median(ordered) * 1000:7.1f} ms  p95 {p95 * 1000:7.1f} ms  (n={len(ordered)})"


def decode_tps(node: LocalNode, model: str, tokens: int) -> float:
    return decode_tokens_per_s(node.url, model, PROMPT, tokens)


def measure_decode(on: LocalNode, off: LocalNode, model: str, tokens: int, rounds: int, what: str = "recorder",
                   target: float = 0.98) -> None:
    compare(what, lambda: decode_tps(on, model, tokens), lambda: decode_tps(off, model, tokens), rounds, target)


def compare(what: str, run_on: Any, run_off: Any, rounds: int, target: float,
            switch: Any = None) -> None:
    """Decode tok/s of `on` and `off`, rounds interleaved ABBA (neither side always runs first); `switch(flag)`
    is called before each side when both sides share one instance (tracing)."""
    with_it: list[float] = []
    without: list[float] = []
    sides = [(True, run_on, with_it), (False, run_off, without)]
    for i in range(rounds + 1):
        for flag, run_side, into in sides if i % 2 == 0 else reversed(sides):
            if switch is not None:
                switch(flag)
            value = run_side()
            if i > 0:  # round 0 warms both sides up (first-request effects)
                into.append(value)
    med = statistics.median
    print(f"decode, {what + ' on':16s} {med(with_it):8.1f} tok/s  {[round(v, 1) for v in with_it]}")
    print(f"decode, {what + ' off':16s} {med(without):8.1f} tok/s  {[round(v, 1) for v in without]}")
    print(f"{what} on / off{'':{max(0, 9 - len(what))}s} {med(with_it) / med(without):8.3f}   (target >= {target})")


def set_tracing(node: LocalNode, enabled: bool) -> None:
    reply = httpx.put(node.url + "/v1/tracing", json={"enabled": enabled}, timeout=30, trust_env=False)
    reply.raise_for_status()
    assert reply.json() == {"enabled": enabled}, reply.text


def measure_latency(asked: LocalNode, victim: LocalNode, calls: int) -> None:
    print(f"per-peer timeout {DEFAULT_PEER_TIMEOUT_S:g} s")
    for path in PATHS:
        print(f"{path:36s} 3 alive      {summary(latencies(asked, path, calls))}")
    assert victim.process is not None
    victim.process.send_signal(signal.SIGSTOP)
    try:  # both at once: the cluster forgets a silent peer after its liveliness lease (~3 s)
        with ThreadPoolExecutor(len(PATHS)) as pool:
            frozen = list(pool.map(lambda path: latencies(asked, path, 1), PATHS))
    finally:
        victim.kill()
    for path, values in zip(PATHS, frozen, strict=True):
        print(f"{path:36s} 1 frozen     {summary(values)}")
    for path in PATHS:
        print(f"{path:36s} 1 killed     {summary(latencies(asked, path, calls))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=BENCH_MODEL_ID)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    nodes: list[LocalNode] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            run(root, args, nodes)
        finally:
            for node in nodes:
                node.stop()
            for node in nodes:
                node.reap_leftovers()


def run(root: Path, args: argparse.Namespace, nodes: list[LocalNode]) -> None:
    """The recorder-on set is 3 nodes (the instance on two, the third is the peer that dies later)."""
    on_set = start_set(root, "on", 3, {}, args.model)
    nodes += on_set
    master = state(on_set[0])["masterNodeId"]
    asked = next(n for n in on_set if n.node_id == master)
    victim = next(n for n in on_set if n.node_id != master)
    off_set = start_set(root, "off", 2, {"SKULK_FLIGHT_RECORDER": "0"}, args.model)
    nodes += off_set
    nolog_set = start_set(root, "nolog", 2, {"SKULK_FLIGHT_RECORDER": "0", "SKULK_EVENT_LOG": "0"}, args.model)
    nodes += nolog_set
    place(asked, args.model, [victim.node_id])
    place(off_set[0], args.model, [])
    place(nolog_set[0], args.model, [])
    print(f"model {args.model}, {args.tokens} tokens per stream, {args.rounds} interleaved rounds")
    measure_decode(asked, off_set[0], args.model, args.tokens, args.rounds)
    measure_decode(off_set[0], nolog_set[0], args.model, args.tokens, args.rounds, "event log")
    tps = lambda: decode_tps(asked, args.model, args.tokens)  # noqa: E731
    compare("tracing", tps, tps, args.rounds, 0.95, switch=lambda flag: set_tracing(asked, flag))
    set_tracing(asked, False)
    measure_latency(asked, victim, args.calls)


if __name__ == "__main__":
    main()
