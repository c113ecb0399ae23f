"""bench/split.py --engine-rows: a Pipeline 2 through whole nodes and the engine alone (bench/split_engine.py's
driver) on the same placement, interleaved in one run, so "through nodes ÷ engine alone" is one printed ratio.

The placement is the one both benches make: the model's layers split as placement splits them over two like nodes,
one rank per core (node0 and its runner on the first core list, node1 and its runner on the second; the engine
alone's rank r on core r), one compute thread each, the same emulated link latency (SKULK_LINK_DELAY_MS at half
the profile's RTT: every rank-to-rank message held on the wire by the sender's delay thread, engines/torch/delay.py;
the nodes' HTTP and zenoh are not delayed), 8 greedy streams of `tokens` tokens. Each side counts its aggregate
the same way (split.steady_aggregate: the sum of each stream's own rate from its first to its last token; the
engine alone's at rank 0 as tokens land there, the nodes' at the client as lines arrive). Micro-batches: as the
engine decides (`Pipeline 2`) and forced on (`P2 always`: SKULK_MICRO_BATCHES=always in the nodes' environment,
engine.micro_batches = True on the engine alone). Each row starts its nodes afresh (a runner reads the setting once);
rounds alternate which side goes first, so a load that drifts hits both alike; each round's own ratio is printed.

CPU per generated token, over the whole 8-stream run (admission to the last token), of each process: the nodes'
node0 (the API, rank 0's node), runner0, node1 (the sampler's node: every token crosses zenoh from it), runner1,
and this bench's own client (it runs on the same two cores); the engine alone's rank 0 and rank 1. Each side's
measured processes run under SCHED_FIFO 10 while they are timed (`realtime`: the machine is shared).

Measured 2026-12-07 15:45-16:00 UTC, 2-core Firecracker VM shared with four other sessions' tests (load average
5.8-7.7; without netem, latency emulated), `sudo .venv/bin/python bench/split.py --engine-rows --models bench
--links lan1g --rounds 2 --tokens 64` (100M int4, layers (0, 6) / (6, 12), 2 micro-batches both sides):
  Pipeline 2 (decided)  nodes 274.7  alone 295.3 tok/s  ÷ 0.93 (rounds 1.01, 0.86)
  P2 always             nodes 273.1  alone 307.7 tok/s  ÷ 0.89 (rounds 0.99, 0.80)
  CPU ms per token, nodes: node0 0.57-0.63, runner0 2.05-2.16, node1 0.36-0.38, runner1 2.16-2.17, client 0.39-0.40;
  alone: rank0 1.89-1.90, rank1 1.96-2.07.
Again 16:05-16:14 UTC (after runner/channel.py's plain pickle; load 6.6-9.7), same command:
  Pipeline 2 (decided)  nodes 242.9  alone 295.3 tok/s  ÷ 0.82 (rounds 0.80, 0.84)
  P2 always             nodes 275.7  alone 255.5 tok/s  ÷ 1.08 (rounds 1.09, 1.06)
  CPU ms per token, nodes: node0 0.59 / 0.79, node1 0.29 / 0.28, client 0.37 / 0.47; runners 2.2-3.7 against the
  ranks' 2.1-2.3 (the nodes' prompts are chat-templated, longer than the engine alone's: their prefill is in it).
Over the 4 rounds of the two runs each row's ratio spans 0.80-1.01 (decided) and 0.80-1.09 (always): on this
machine, shared with other sessions' tests, the spread is larger than the 5 % the target asks to resolve.
On this loaded machine neither side's ranks were CPU-bound (a rank spent ~2 ms of CPU per token at ~280-330 tok/s:
busy ~60 % of the time), so the node processes' CPU per token (node0 0.6 ms on rank 0's core, node1 0.37 on rank
1's) showed mostly as spread; where a rank's core is the bound (a quiet machine: ~1,300 tok/s), the same 0.6 ms on
rank 0's core is what the ratio loses (1 / (1 + 0.6 / 2) ~ 0.77-0.9, the issue's 0.82-0.90).

Where the node path's CPU goes (2026-12-07, `SKULK_LINK_DELAY_MS=0.25 SKULK_MICRO_BATCHES=always bench/node_path.py
--spy --spy-gil --quantization int4 --ranks 2 --cores 0/1 --streams 8 --tokens 64 --rounds 1`, own and inclusive
shares of the GIL holder's samples): no round trip per micro-batch anywhere (rank 0's runner sends nothing per
step; the sampler's runner one Tokens message per micro-batch, no acknowledgement). node0 (API, rank 0's core):
the SSE responses through the middleware chain ~25 %, the data plane's receive (HandOver._drain, one zenoh sample,
unseal and JSON validation per token) ~10 %, and time-driven work that is no token's (topology probes over HTTP
~11 %, psutil reads): at a slow aggregate that reads as more CPU per token. node1 (the sampler's node, rank 1's
core): relaying the runner's Tokens ~36 % (pipe read and unpickle 13 %, one model_dump_json + seal + zenoh put per
token 14 %), topology probes ~24 %. Runners: the emulated latency's DelayedSends.post (Condition.notify) 16-25 %,
on the engine alone too; the sampler's runner building and pickling its Tokens 13 % (ForkingPickler built per
message 5 %: now plain pickle, runner/channel.py). Since then a step's tokens for another API node cross as one
data-plane message (cluster/dataplane.publish_step, sent where zenoh says that node subscribes to its batch key).

Measured 2026-12-08 02:37-02:40 UTC, the same VM quiet (load average 0.7-1.6, nothing else running), main at
d1f220d, the same command:
  Pipeline 2 (decided)  nodes 294.1  alone 337.7 tok/s  ÷ 0.87 (rounds 0.82, 0.94)
  P2 always             nodes 332.7  alone 364.9 tok/s  ÷ 0.91 (rounds 1.03, 0.82)
  CPU ms per token, nodes: node0 0.61 / 0.41, runner0 3.04 / 1.75, node1 0.20 / 0.30, runner1 2.80 / 1.88,
  client 0.41 / 0.33; alone: rank0 1.66 / 1.71, rank1 1.85 / 1.90.
Quiet, the rounds still span 0.82-1.03: the 0.95 target is neither met nor refuted at this spread. The runners'
CPU per token where the engine decides (3.04 / 2.80 against 1.75 / 1.88 forced on) was not seen again minutes later
in bench/node_path.py (`SKULK_LINK_DELAY_MS=0.25 ... --quantization int4 --ranks 2 --cores 0/1 --streams 8
--tokens 64 --rounds 2`, SKULK_MICRO_BATCHES unset / always / never): 300 / 339 / 349 tok/s, runner0 2.17 / 2.02 /
1.30 ms a token; again right after (decided, never, decided, always): 257 / 287 / 306 / 279 tok/s, runner0 2.27 /
1.63 / 2.29 / 2.40. The three schedules' throughputs are within this machine's noise of each other; the plain
schedule's CPU per token is the lowest every time (each rank reads its weights once a round, not once a
micro-batch: the module docstring of engines/micro_batching.py).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import psutil

from node_path import cpu_s  # bench/ is on the path: split.py, which imports this module, runs from there
from skulk.engines.link_delay import DELAY_ENV
from skulk.engines.micro_batching import MICRO_BATCHES_ENV

ROWS = (("Pipeline 2", None), ("P2 always", "always"))
"""(label, SKULK_MICRO_BATCHES): micro-batches as the engine decides, and always on."""


FIFO_ENV = "SKULK_BENCH_FIFO"
"""Set by this bench for split_engine's ranks: each puts its threads under SCHED_FIFO once warm (realtime)."""


def realtime(pids: list[int], on: bool) -> None:
    """Every thread of these processes under SCHED_FIFO 10 (on) or back to the normal policy: on a machine other
    work shares, the measured processes then take their cores whenever they are runnable, and the rest waits.
    Only around the measurement: nodes started under FIFO did not form a cluster here (a spinning thread of
    equal priority is never preempted)."""
    policy, param = (os.SCHED_FIFO, os.sched_param(10)) if on else (os.SCHED_OTHER, os.sched_param(0))
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in threads:
            try:
                os.sched_setscheduler(int(tid), policy, param)
            except (ProcessLookupError, PermissionError):
                continue


def node_pids(nodes: list[Any]) -> dict[str, int]:
    """node0, runner0, node1, runner1 (a node's runner: the spawned child that serves its rank)."""
    found: dict[str, int] = {}
    for index, node in enumerate(nodes):
        found[f"node{index}"] = node.process.pid
        for pid in sorted(node.runner_pids()):
            found[f"runner{index}"] = pid
    found["client"] = os.getpid()
    return found


def stop(nodes: list[Any], pids: dict[str, int]) -> None:
    """The nodes, and whatever of theirs outlived them (a node process started under `ip netns exec`)."""
    for node in nodes:
        node.stop()
    for node in nodes:
        node.reap_leftovers()
    for name, pid in pids.items():
        if name != "client" and psutil.pid_exists(pid):
            psutil.Process(pid).kill()
    time.sleep(2)  # what the nodes leave to the kernel settles before the engine alone is timed


def through_nodes(split: Any, nodes: list[Any], key: str, tokens: int) -> dict[str, Any]:
    """Pipeline 2 over the two nodes: 8 streams' steady aggregate and each process's CPU ms per token."""
    model, quant = split.MODELS[key]
    api = nodes[0]
    instance_id, runners = split.place(api, nodes, nodes, model, quant, "Pipeline")
    try:
        asyncio.run(split.measure(api.url, model, 8, 1))  # warm-up: one stream, then 8 (first-call allocations)
        pids = node_pids(nodes)

        async def many() -> list[Any]:
            async with httpx.AsyncClient(base_url=api.url, timeout=600, trust_env=False) as client:
                return list(await asyncio.gather(*(split.one_stream(client, model, tokens, 100 + i)
                                                   for i in range(split.STREAMS_AGGREGATE))))

        realtime(list(pids.values()), True)
        try:
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            streams = asyncio.run(many())
            after = {name: cpu_s(pid) for name, pid in pids.items()}
        finally:
            realtime(list(pids.values()), False)
        produced = sum(s.produced for s in streams)
        return {"steady": split.steady_aggregate(streams),
                "cpu": {name: (after[name] - before[name]) * 1000 / produced for name in pids}}
    finally:
        split.delete(api, instance_id, runners)


def engine_alone(split_engine: Any, model_dir: Path, quant: str | None, card: Any, forced: str | None,
                 tokens: int) -> dict[str, Any]:
    detail = split_engine.measure_detail(model_dir, quant, card, 2, "always" if forced else "pipeline", tokens)
    return {"steady": detail["steady"], "micro": detail["micro"],
            "cpu": {f"rank{r}": c for r, c in enumerate(detail["ranks"])}}


def model_dirs(keys: list[str], models: dict[str, tuple[str, str | None]], tmp: Path) -> dict[str, Path]:
    from skulk.models.demo import BUILTIN_MODELS, ensure_builtin_model
    from skulk.models.packaged import ensure_packaged_model, shared_cache

    return {key: ensure_builtin_model(models[key][0], tmp) if models[key][0] in BUILTIN_MODELS else
            ensure_packaged_model(models[key][0], tmp, cache=shared_cache()) for key in keys}


def cells(cpu: dict[str, float]) -> str:
    return " ".join(f"{name} {value:5.2f}" for name, value in cpu.items())


def run(split: Any, ns: Any, cores: list[str], profile: Any, keys: list[str], tokens: int, rounds: int) -> None:
    """Every round: each row through nodes and alone, in alternating order; then the medians and their ratio."""
    sys.path.insert(0, str(Path(__file__).parent))
    import split_engine

    os.environ[DELAY_ENV] = f"{profile.rtt_ms / 2:g}"  # the engine alone's ranks inherit it, as the nodes do
    os.environ[FIFO_ENV] = "1"
    got: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(keys, split.MODELS, Path(tmp))
        cards = {key: split_engine.placed_card(*split.MODELS[key]) for key in keys}
        for round_no in range(rounds):
            for label, forced in ROWS:
                sides = ("nodes", "engine") if round_no % 2 == 0 else ("engine", "nodes")
                for side in sides:
                    if side == "engine":
                        for key in keys:
                            quant = split.MODELS[key][1]
                            got[key, label, side].append(engine_alone(split_engine, dirs[key], quant, cards[key],
                                                                      forced, tokens))
                        continue
                    extra = {MICRO_BATCHES_ENV: forced or ""}
                    nodes = split.start_nodes(ns, Path(tmp) / f"r{round_no}{label[:2]}", cores, profile, extra)
                    started = node_pids(nodes)
                    try:
                        for key in keys:
                            got[key, label, side].append(through_nodes(split, nodes, key, tokens))
                    finally:
                        stop(nodes, started)
                for key in keys:
                    n, e = got[key, label, "nodes"][-1], got[key, label, "engine"][-1]
                    load.append(os.getloadavg()[0])
                    print(f"  round {round_no + 1} {key:8} {label:10} nodes {n['steady']:7.1f} tok/s "
                          f"[{cells(n['cpu'])}]  alone {e['steady']:7.1f} (micro {e['micro']}) "
                          f"[{cells(e['cpu'])}]  nodes ÷ alone {n['steady'] / e['steady']:.2f}  "
                          f"load {load[-1]:.1f}", flush=True)
    print(f"\nthrough nodes against the engine alone, {profile.name} ({profile.rtt_ms} ms RTT emulated), 8 streams x "
          f"{tokens} tokens, one thread per rank on cores {cores}, medians of {rounds} alternating rounds; load "
          f"average (1 min) {min(load):.1f}-{max(load):.1f}; CPU ms per generated token")
    print(f"{'model':8} {'placement':10} | {'nodes':>7} {'alone':>7} {'÷':>5} | rounds' ÷ | CPU nodes | CPU alone")
    for key in keys:
        for label, _ in ROWS:
            nodes_rows, alone_rows = got[key, label, "nodes"], got[key, label, "engine"]
            n = statistics.median(r["steady"] for r in nodes_rows)
            e = statistics.median(r["steady"] for r in alone_rows)
            each = " ".join(f"{a['steady'] / b['steady']:.2f}" for a, b in zip(nodes_rows, alone_rows, strict=True))
            cpu_n = {k: statistics.median(r["cpu"][k] for r in nodes_rows) for k in nodes_rows[0]["cpu"]}
            cpu_e = {k: statistics.median(r["cpu"][k] for r in alone_rows) for k in alone_rows[0]["cpu"]}
            print(f"{key:8} {label:10} | {n:7.1f} {e:7.1f} {n / e:5.2f} | {each} | {cells(cpu_n)} | {cells(cpu_e)}")
