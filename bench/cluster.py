"""Cluster figures, measured in one run on three real node processes on loopback (CPU, explicit endpoints).

Targets:
  decode tokens/s, Pipeline over 2 ranks ÷ 1 rank                      (target ≥ 0.85)
  decode tokens/s, Pipeline over 3 ranks ÷ 1 rank                      (target ≥ 0.85)
  8-stream aggregate decode tokens/s, Pipeline over 2 ranks ÷ 1 rank   (reported; ≥ 1.6 needs a core per rank)
  cluster formation, 3 nodes: start → one master, 3 nodes, 6 links    (reported)
  kill -9 of the master → the survivors agree on a new master          (target ≤ 3 s)
  kill -9 of a worker holding a rank → the client's SSE error event    (target ≤ 2 s; runbook anchor 4-6 s)

Decode rates are single-stream greedy on the built-in ~100M-parameter `skulk/bench-random-100m`, timed from
the first to the last streamed token (median of 3 streams per placement); 1-, 2- and 3-rank placements are
interleaved within each round (each instance deleted before the next is placed) and the median over rounds is
used, so machine noise hits all alike. Formation also shows when all three processes had printed ready
(interpreter and import start-up), to tell start-up cost from discovery and election.
The kill figures are measured once each: master first, then the killed node is restarted so the worker kill
happens in a full three-node cluster again. Other processes on the machine skew every figure: run it alone.

The aggregate is --streams concurrent greedy streams (distinct prompts): all their tokens over the time from
sending them to the last token (their prefill included). --threads sets OMP_NUM_THREADS in the nodes (one
compute thread per rank: the hop cost without the ranks taking each other's cores). --src, given twice or more,
measures each source tree (its `src` on the nodes' PYTHONPATH) in its own three-node cluster, interleaved round
by round, and prints each tree's rows side by side (the kill figures then run on the first tree only).

Run: .venv/bin/python bench/cluster.py [--tokens 64] [--rounds 3] [--engine torch|mlx] [--threads 1]
         [--streams 8] [--src /path/to/main/src --src src] [--no-kills]
     (--engine mlx: the same figures with MLX ranks, Pipeline over MLX's ring backend on loopback)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from skulk.models.demo import BENCH_MODEL_ID
from skulk.testing.convergence import formed, master_of, state_of
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import decode_tokens_per_s, stream_chunk
from skulk.testing.waiting import wait_until

PROMPT = "Benchmark the pipeline path of a distributed inference cluster, please."
NODE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Co-located ranks must not spin on cores another rank needs (runner_main also sets it for world_size > 1)."""
STREAMS_PER_PLACEMENT = 3
"""Streams timed per placement (median kept): loading costs far more than decoding, so sample it well."""


@dataclass(frozen=True)
class Figure:
    name: str
    value: str
    target: str
    ok: bool | None  # None: reported, no target


class Fleet:
    """The bench's node processes: the live three, plus every one ever started so cleanup reaches killed ones."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.cluster = f"bench{uuid.uuid4().hex[:8]}"
        self.nodes: list[LocalNode] = []
        self.started: list[LocalNode] = []
        self.env = {**NODE_ENV, **(env or {})}

    def spawn(self, index: int, peers: list[str]) -> LocalNode:
        node = LocalNode(home=self.root / f"node{index}", cluster=self.cluster, peers=peers, extra_env=dict(self.env))
        self.started.append(node)
        return node.start()

    def stop_all(self) -> None:
        """Stop every node ever started, then kill any runner that outlived its node."""
        for node in self.started:
            node.stop()
        for node in self.started:
            node.reap_leftovers()


def measure_formation(fleet: Fleet) -> tuple[float, float]:
    """Start three processes back to back (each bootstraps to the earlier ones) and time until formed.

    Returns (seconds to formed, seconds until all three had printed ready)."""
    started = time.monotonic()
    for index in range(3):
        fleet.nodes.append(fleet.spawn(index, [n.endpoint for n in fleet.nodes]))
    wait_until(lambda: all(n.node_id for n in fleet.nodes), 60, "three nodes to print ready")
    ready = time.monotonic() - started
    wait_until(lambda: formed(fleet.nodes), 60, "three nodes to form one cluster", poll=0.02)
    return time.monotonic() - started, ready


def runners_of(reply: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(runner ids, node ids) of a placement reply: the rank count is read back, never assumed."""
    assignments = reply["instance"]["MlxRingInstance"]["shardAssignments"]
    return set(assignments["runnerToShard"]), set(assignments["nodeToRunner"])


def instance_ready(api: LocalNode, instance_id: str, runners: set[str]) -> bool:
    state = state_of(api)
    if state is None or instance_id not in state["instances"]:
        return False
    return all("RunnerReady" in state["runners"].get(r, {}) for r in runners)


ENGINE = ["torch"]
"""The engine every placement of this run asks for (--engine)."""


def place_on(api: LocalNode, members: list[LocalNode], everyone: list[LocalNode], quantization: str | None = None,
             model: str = BENCH_MODEL_ID) -> tuple[str, set[str]]:
    """Place a Pipeline instance on exactly `members` (the rest excluded), quantized at load when asked; check the
    reply says so."""
    body: dict[str, object] = {
        "model_id": model,
        "sharding": "Pipeline",
        "min_nodes": len(members),
        "engine": ENGINE[0],
        "excluded_nodes": [n.node_id for n in everyone if n not in members],
        **({"quantization": quantization} if quantization else {}),
    }
    with api.client(timeout=120) as client:
        reply = client.post("/place_instance", json=body)
    if reply.status_code != 200:
        raise RuntimeError(f"placement of {len(members)} ranks refused: {reply.text}")
    runners, node_ids = runners_of(reply.json())
    if len(runners) != len(members) or node_ids != {n.node_id for n in members}:
        raise RuntimeError(f"asked for {len(members)} ranks on {len(members)} nodes, got {len(runners)} on {node_ids}")
    instance_id = reply.json()["instanceId"]
    wait_until(lambda: instance_ready(api, instance_id, runners), 240, f"{len(members)}-rank instance", poll=0.2)
    return instance_id, runners


def delete_instance(api: LocalNode, instance_id: str, runners: set[str]) -> None:
    """Delete and wait until its runners are gone too, so no exiting rank competes with the next placement."""
    with api.client(timeout=60) as client:
        client.delete(f"/instance/{instance_id}").raise_for_status()

    def gone() -> bool:
        state = state_of(api)
        return state is not None and instance_id not in state["instances"] and not runners & set(state["runners"])

    wait_until(gone, 60, f"instance {instance_id} and its runners to go", poll=0.1)


def stream_decode(api: LocalNode, tokens: int) -> float:
    return decode_tokens_per_s(api.url, BENCH_MODEL_ID, PROMPT, tokens, timeout=300)


async def _timed_stream(client: httpx.AsyncClient, index: int, tokens: int, model: str = BENCH_MODEL_ID
                        ) -> tuple[int, float]:
    """(tokens, last-token time) of one greedy stream with its own prompt."""
    body = {"model": model, "messages": [{"role": "user", "content": f"stream {index}: {PROMPT}"}],
            "max_tokens": tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    last = 0.0
    produced = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"stream refused: {reply.status_code} {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            chunk = stream_chunk(line)
            if chunk is None:
                continue
            if chunk >= 0:
                produced = chunk
                continue
            last = time.perf_counter()
    return produced, last


def aggregate_decode(api: LocalNode, tokens: int, streams: int, model: str = BENCH_MODEL_ID) -> float:
    """Tokens/s of `streams` concurrent streams together: all their tokens over the time from sending them to the
    last token (prefill included; streamed text can arrive in bursts, so no first-token clock is trusted)."""

    async def run() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=api.url, timeout=600, trust_env=False) as client:
            return await asyncio.gather(*(_timed_stream(client, i, tokens, model) for i in range(streams)))

    sent = time.perf_counter()
    results = asyncio.run(run())
    return sum(r[0] for r in results) / (max(r[1] for r in results) - sent)


@dataclass
class Rates:
    """One tree's figures over the rounds: single-stream decode per rank count, and the aggregate of many."""

    single: dict[int, list[float]]
    aggregate: dict[int, list[float]]


def measure_placement(nodes: list[LocalNode], ranks: int, tokens: int, streams: int, rates: Rates) -> None:
    api = nodes[0]
    instance_id, runners = place_on(api, nodes[:ranks], nodes)
    try:
        stream_decode(api, 8)  # warm-up: first-call allocations and group warm paths
        rates.single[ranks].append(statistics.median(stream_decode(api, tokens) for _ in range(STREAMS_PER_PLACEMENT)))
        if streams > 1 and ranks <= 2:
            rates.aggregate[ranks].append(aggregate_decode(api, tokens, streams))
    finally:
        delete_instance(api, instance_id, runners)


def measure_scaling(fleets: list[list[LocalNode]], tokens: int, rounds: int, streams: int) -> list[Rates]:
    """Interleave 1-, 2- and 3-rank placements each round (order rotated), and the trees within each, so drift hits
    every rank count and every tree alike."""
    rates = [Rates({1: [], 2: [], 3: []}, {1: [], 2: []}) for _ in fleets]
    for round_no in range(rounds):
        order = [1, 2, 3][round_no % 3 :] + [1, 2, 3][: round_no % 3]
        for ranks in order:
            trees = range(len(fleets)) if round_no % 2 == 0 else reversed(range(len(fleets)))
            for tree in trees:
                measure_placement(fleets[tree], ranks, tokens, streams, rates[tree])
                line = f"{rates[tree].single[ranks][-1]:7.1f} tok/s"
                if rates[tree].aggregate.get(ranks):
                    line += f", {streams} streams {rates[tree].aggregate[ranks][-1]:7.1f} tok/s"
                print(f"  round {round_no + 1} tree {tree} ranks {ranks}: {line}", flush=True)
    return rates


def sigkill(node: LocalNode) -> float:
    """`kill -9` the node process; return the moment the signal was sent (descendants noted first for reaping)."""
    node.child_pids()
    assert node.process is not None
    killed_at = time.monotonic()
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(10)
    return killed_at


def measure_master_kill(nodes: list[LocalNode]) -> tuple[float, LocalNode]:
    """Kill the master; time until both survivors name the same new master. Returns (seconds, killed node)."""
    old = master_of(nodes[0])
    master = next(n for n in nodes if n.node_id == old)
    survivors = [n for n in nodes if n is not master]
    killed_at = sigkill(master)

    def agreed() -> bool:
        seen = {master_of(n) for n in survivors}
        return len(seen) == 1 and seen.pop() in {n.node_id for n in survivors}

    wait_until(agreed, 30, "the survivors to agree on a new master", poll=0.005)
    return time.monotonic() - killed_at, master


def restart(fleet: Fleet, dead: LocalNode) -> None:
    """Bring the killed node back (same home, fresh ports) so the next figure runs on three nodes again."""
    index = fleet.nodes.index(dead)
    peers = [n.endpoint for n in fleet.nodes if n is not dead]
    fleet.nodes[index] = fleet.spawn(index, peers).wait_ready()
    wait_until(lambda: formed(fleet.nodes), 60, "the restarted node to rejoin", poll=0.05)


def first_error_after_kill(api: LocalNode, worker: LocalNode) -> float:
    """Stream a long completion through `api`, kill `worker` mid-stream, time until the SSE error event."""
    body = {
        "model": BENCH_MODEL_ID,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 1500,
        "temperature": 0.0,  # greedy: sampled, a random model may end on its own before the kill lands (MLX)
        "stream": True,
    }
    with (
        httpx.Client(base_url=api.url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        reply.raise_for_status()
        lines = reply.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: {")
            if seen >= 4:  # well into decode, not racing prefill
                break
        killed_at = sigkill(worker)
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                elapsed = time.monotonic() - killed_at
                print(f"  error event: {json.loads(line[6:])['error'].get('message', '')[:100]}", flush=True)
                return elapsed
            if line == "data: [DONE]":
                break
    raise RuntimeError("the stream ended without an error event after the worker was killed")


def measure_worker_kill(nodes: list[LocalNode]) -> float:
    """A 2-rank instance on the two non-master nodes; the stream goes through one of them, the other is killed."""
    master = master_of(nodes[0])
    api, worker = [n for n in nodes if n.node_id != master]
    place_on(api, [api, worker], nodes)
    return first_error_after_kill(api, worker)


def ratio_figures(rates: Rates, streams: int, tag: str = "") -> list[Figure]:
    one = statistics.median(rates.single[1])
    figures = [Figure(f"{tag}decode 1 rank (tok/s)", f"{one:.1f}", "baseline", None)]
    for ranks in (2, 3):
        ratio = statistics.median(rates.single[ranks]) / one
        figures.append(
            Figure(
                f"{tag}decode {ranks} ranks ÷ 1 rank",
                f"{ratio:.3f} ({statistics.median(rates.single[ranks]):.1f} tok/s)",
                "≥ 0.85",
                ratio >= 0.85,
            )
        )
    if rates.aggregate[1] and rates.aggregate[2]:
        one_agg, two_agg = statistics.median(rates.aggregate[1]), statistics.median(rates.aggregate[2])
        figures.append(Figure(f"{tag}{streams} streams 1 rank (tok/s)", f"{one_agg:.1f}", "baseline", None))
        figures.append(Figure(f"{tag}{streams} streams 2 ranks ÷ 1 rank",
                              f"{two_agg / one_agg:.3f} ({two_agg:.1f} tok/s)", "reported", None))
    return figures


def print_table(figures: list[Figure]) -> None:
    width = max(len(f.name) for f in figures)
    value_width = max(len(f.value) for f in figures)
    print(f"\n{'figure':<{width}}  {'value':<{value_width}}  {'target':<14}  result")
    for f in figures:
        verdict = "-" if f.ok is None else ("PASS" if f.ok else "FAIL")
        print(f"{f.name:<{width}}  {f.value:<{value_width}}  {f.target:<14}  {verdict}")


def run(fleets: list[Fleet], args: argparse.Namespace) -> list[Figure]:
    formation, ready = 0.0, 0.0
    for fleet in fleets:
        formation, ready = measure_formation(fleet)
        print(f"formed in {formation:.2f} s", flush=True)
    print(f"measuring decode, {args.rounds} rounds of {args.tokens} tokens", flush=True)
    rates = measure_scaling([f.nodes for f in fleets], args.tokens, args.rounds, args.streams)
    figures: list[Figure] = []
    for tree, tree_rates in enumerate(rates):
        figures += ratio_figures(tree_rates, args.streams, f"[{tree}] " if len(fleets) > 1 else "")
    if len(fleets) > 1:
        for name, pick in [("decode 2 ranks", lambda r: r.single[2]), ("decode 3 ranks", lambda r: r.single[3]),
                           (f"{args.streams} streams 2 ranks", lambda r: r.aggregate[2])]:
            if all(pick(r) for r in rates):
                ratio = statistics.median(pick(rates[1])) / statistics.median(pick(rates[0]))
                figures.append(Figure(f"{name}: [1] ÷ [0]", f"{ratio:.3f}", "reported", None))
    figures.append(Figure("formation, 3 nodes", f"{formation:.2f} s (ready {ready:.2f} s)", "reported", None))
    if args.no_kills:
        return figures
    fleet = fleets[0]
    failover, dead = measure_master_kill(fleet.nodes)
    print(f"new master after {failover:.3f} s; restarting the killed node", flush=True)
    restart(fleet, dead)
    worker_error = measure_worker_kill(fleet.nodes)
    return [
        *figures,
        Figure("kill -9 master → new master", f"{failover:.3f} s", "≤ 3 s", failover <= 3.0),
        Figure("kill -9 worker → SSE error", f"{worker_error:.3f} s", "≤ 2 s (4-6 s)", worker_error <= 2.0),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per measured stream")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of 1/2/3-rank placements")
    parser.add_argument("--engine", choices=["torch", "mlx"], default="torch", help="the engine of every rank")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every node and its ranks")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams of the aggregate (1: none)")
    parser.add_argument("--src", action="append", default=[], help="a source tree to measure (twice: side by side)")
    parser.add_argument("--no-kills", action="store_true", help="leave out the kill figures")
    args = parser.parse_args()
    ENGINE[0] = args.engine
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    trees = [str(Path(src).resolve()) for src in args.src] or [None]
    with tempfile.TemporaryDirectory() as tmp:
        inherited = os.environ.get("PYTHONPATH", "")
        fleets = [Fleet(Path(tmp) / f"tree{i}", {**env, **({"PYTHONPATH": f"{tree}{os.pathsep}{inherited}"} if tree
                                                           else {})}) for i, tree in enumerate(trees)]
        try:
            figures = run(fleets, args)
        finally:
            for fleet in fleets:
                fleet.stop_all()
    for i, tree in enumerate(trees):
        print(f"[{i}] {tree or os.environ.get('PYTHONPATH') or 'installed skulk'}")
    print(f"\nmodel {BENCH_MODEL_ID}, engine {args.engine}, {args.tokens} tokens, median of {args.rounds} "
          f"interleaved rounds, OMP_NUM_THREADS={args.threads or 'unset'}")
    print_table(figures)


if __name__ == "__main__":
    main()
