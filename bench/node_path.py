"""CPU per generated token in each process of the node path, with real node processes: one stream, or 8 at once.

The per-token path runs runner -> supervisor (pipe) -> worker -> zenoh (when the API node is another node) -> API
node -> SSE. This bench places a 1-rank instance (runner and API on one node) and a Pipeline 2 instance (API node
holds rank 0; the tokens are sampled on the other node's rank and cross zenoh), runs --streams concurrent greedy
streams through the API node and reads every process's CPU time (psutil) before and after: CPU ms per generated
token per process, beside the aggregate tokens/s. With --spy, py-spy samples every process during the streams and
the top functions (own samples) of each process are printed: where the per-token CPU goes (py-spy is not a
dependency: `pip install py-spy` into the venv, or PY_SPY=/path/to/py-spy).

--src, given twice or more, runs each source tree in its own two-node cluster, interleaved round by round (order
alternating), and prints the trees side by side: a change to the node path measured against the tree before it in
one run, on the same loaded machine.

Measured here (2-core VM shared with other work, load 7-11, SKULK_SPECULATE=0, OMP_NUM_THREADS=1, 8 streams x 64
tokens of the built-in 100M model in float32 (placed unquantized, bench/cluster.py's place_on), medians of 2
rounds, trees interleaved; CPU ms per generated token):
  1 rank      main 72.2 tok/s: node0 0.41, runner0 5.55, idle node1 0.21
              HandOver (6a11808) 89.6 tok/s: node0 0.37, runner0 5.66
  Pipeline 2  main 42.7 tok/s: node0 (API, rank 0) 0.76, runner0 9.35, node1 (sampler) 0.40, runner1 8.62
              HandOver 50.8 tok/s: node0 0.62, runner0 6.04, node1 0.35, runner1 5.66
              HandOver, engine.micro_batches = False: 116.0 tok/s: node0 0.35, runner0 2.85, node1 0.24, runner1 2.94
So the node processes are 0.2-0.4 ms per token above an idle node (SSE socket writes, the chunk's pydantic
encode/decode and zenoh put/receive when the sampler is on another node), 4-10 % of a token's CPU; the runners are
85-95 % in the layer kernels (py-spy). What makes Pipeline 2 lose at 8 streams on this machine is the micro-batched
schedule: each rank runs two 4-row forwards per 8 tokens, and a 4-row forward of float32 weights costs about
what an 8-row one does (weight-bound), so a rank's CPU per token is 2-3x that of the unpipelined schedule; with
ranks that do not have their own free cores that CPU is the throughput. (The engine now pipelines micro-batches
only where its measured pace says the round is shorter, engines/micro_batching.py; on a machine whose cores the
ranks share with other work, a shorter round can still cost more CPU.)

The same with the model quantized at load (--quantization int4 --ranks 1 --rounds 1 --tokens 96, 8 streams, quiet
machine, 2026-11-26): 730 tok/s, CPU ms per token node0 0.16, runner0 1.28; every process on one core (taskset -c 0,
this bench's client too) 642 tok/s. (bench/split.py's ~300 for the same placement that day was its own count of
text lines, not tokens; fixed there.)

--streams 1 times one stream from its first token to its last and reads each process's CPU over that window only
(the request's admission and prefill left out); --model smollm2 places the default model; --cores 0/1 pins each node
(all its threads, and so its runner) to its cores, as bench/split.py does; --engine adds one stream stepped by the
engine alone on core 0 (what the node path would reach if it cost nothing); --spy-gil samples only the GIL's holder
(Python's own CPU, SPY_RATE=1000 for more samples). Each placement prints which node samples: the last rank's node,
when it is not the API node, sends every token over zenoh.

Measured 2026-11-26 (2-core VM, quiet window, load 1.4-1.9; SmolLM2, --cores 0/1, 400 tokens; CPU ms per token):
  one stream, 1 rank: engine alone 111-147 tok/s (CPU 6.8-9.0 ms/token); nodes 88-105 tok/s, 0.80-0.81 of the
  engine alone in the same run, node0 (API + runner's node) 0.53-0.65, runner0 8.8-10.5. The runner's own loop
  (thread CPU clocks around engine.step()) costs 0.13-0.16 ms a step (0.23-0.24 before runner/channel.py: the
  mp.Queue feeder thread's 0.10 is gone); the rest of the gap is node0's Python per token (py-spy --gil: its
  pipe read and unpickle ~18 %, the SSE send through the middleware chain ~14 %, the event log's writer ~10 %,
  background probes and state polls the rest) and, mostly, noise: the same engine alone, started afresh, decodes
  at 108-162 tok/s from one process to the next (identical configuration, quiet machine), so a node path's
  runner lands anywhere in that range too.
  before/after runner/channel.py (trees interleaved, 4 rounds, medians): one stream, 1 rank 105.6 -> 104.2 tok/s
  (0.99), Pipeline 2 110.9 -> 117.8 (1.06); 8 streams x 64 tokens (3 rounds), 1 rank 367 -> 401 (1.09), Pipeline
  2 315 -> 434 (1.38, but the new tree's placements put the sampling rank on node1 and its ranks' CPU per token
  fell 1.8 -> 1.3 ms: a different split/schedule, not the pipe).

2026-12-07 22:40 UTC, the step batches (cluster/dataplane.publish_step) against the tree before them (56a292d), a
Pipeline 2 with the API on the node that does not sample (so every token crosses zenoh; before this date the bench
sent its requests to node0, which the placement may make the sampler), --ranks 2 --streams 16 --tokens 64
--rounds 2 --quantization int4, load average 8-12 from other sessions' tests: API node 0.73 -> 0.69 ms CPU a token,
sampling node 0.50 -> 0.49, the rounds spreading 0.53-0.93 on the same tree: the gain (bench/dataplane.py: 0.13 ->
0.05 ms a token for the data plane alone, both ends) is under this machine's noise here.

Run: .venv/bin/python bench/node_path.py [--streams 8] [--tokens 64] [--rounds 2] [--spy] [--spy-gil]
         [--src /path/to/main/src --src src] [--quantization int4] [--ranks 1,2] [--model smollm2] [--cores 0/1]
         [--engine]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from cluster import Fleet, aggregate_decode, delete_instance, place_on
from skulk.models.demo import BENCH_MODEL_ID
from skulk.models.packaged import DEFAULT_MODEL_ID, shared_cache
from skulk.testing.convergence import formed, state_of
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import stream_chunk
from skulk.testing.waiting import wait_until

SPY = os.environ.get("PY_SPY", str(Path(sys.executable).parent / "py-spy"))


def roles(nodes: list[LocalNode]) -> dict[str, int]:
    """Process name -> pid: each node, and the runner of each node that holds a rank."""
    found: dict[str, int] = {}
    for index, node in enumerate(nodes[:2]):
        assert node.process is not None
        found[f"node{index}"] = node.process.pid
        for pid in sorted(node.runner_pids()):
            found[f"runner{index}"] = pid
    return found


def cpu_s(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def spy(pids: dict[str, int], out: Path, gil: bool = False) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
    """py-spy on every process; gil: sample only the thread holding the GIL (Python's own CPU, without the
    kernels that run with it released)."""
    spies = []
    for name, pid in pids.items():
        path = out / f"{name}.txt"
        cmd = [SPY, "record", "--pid", str(pid), "--format", "raw", "--rate", os.environ.get("SPY_RATE", "200"),
               "--nonblocking", *(["--gil"] if gil else []), "--output", str(path)]
        spies.append((name, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path))
    time.sleep(1.0)  # py-spy attaches
    return spies


def top_functions(path: Path, count: int) -> list[tuple[float, str]]:
    """(share of samples, function) by own samples, from py-spy's collapsed stacks; idle waits left out."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        if any(idle in leaf for idle in ("select (", "poll (", "wait (", "_recv (", "epoll", "acquire (")):
            continue
        own[leaf] += int(samples)
        total += int(samples)
    return [(n / total, f) for f, n in own.most_common(count)] if total else []


MODELS = {"bench": BENCH_MODEL_ID, "smollm2": DEFAULT_MODEL_ID}
PROMPT = "Write a short story about a fox who learns to split a model across two machines."


async def _single(url: str, model: str, tokens: int, pids: dict[str, int]
                  ) -> tuple[int, float, dict[str, float], dict[str, float]]:
    """One greedy stream: (tokens after the first, seconds from first to last token, each process's CPU seconds at
    the first token, and at the last)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    at_first: dict[str, float] = {}
    at_last: dict[str, float] = {}
    produced = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            chunk = stream_chunk(line)
            if chunk is None:
                continue
            if chunk >= 0:
                produced = chunk
                continue
            last = time.perf_counter()
            if not first:
                first, at_first = last, {name: cpu_s(pid) for name, pid in pids.items()}
            else:
                at_last = {name: cpu_s(pid) for name, pid in pids.items()}
                last = time.perf_counter()  # psutil's reads are the client's, not the node path's
    if produced < 2 or not at_last:
        raise RuntimeError(f"too few tokens streamed ({produced})")
    return produced - 1, last - first, at_first, at_last


def _engine_stream(model_dir: Path, quantization: str | None, tokens: int, results: Any) -> None:
    """Spawned: one greedy stream stepped directly on core 0 with one thread, as the runner's engine would be
    (warmed up, collector frozen); puts (tokens after the first, wall s, process CPU s) from its first token on."""
    os.sched_setaffinity(0, {0})
    import gc

    import torch

    from skulk.engines.torch.engine import TorchEngine
    from skulk.types.chat import SamplingParams

    torch.set_num_threads(1)
    engine = TorchEngine(model_dir, quantize=quantization, speculate=False)
    engine.warmup()
    gc.freeze()
    figures = []
    for label, count in (("warm", 8), ("timed", tokens)):
        engine.add_request(label, list(PROMPT.encode()), SamplingParams(max_tokens=count, temperature=0))
        produced, start = 0, (0.0, 0.0)
        while engine.has_work():
            produced += len(engine.step())
            engine.take_events()
            if produced == 1 and not start[0]:
                start = (time.perf_counter(), time.process_time())
        figures.append((produced - 1, time.perf_counter() - start[0], time.process_time() - start[1]))
    results.put(figures[-1])


def engine_alone(model: str, quantization: str | None, tokens: int) -> tuple[float, float]:
    """One stream's (decode tok/s, CPU ms per token) with the engine driven directly on core 0 with one thread:
    what the node path would reach if it cost nothing."""
    import multiprocessing as mp

    from skulk.models.demo import ensure_builtin_model
    from skulk.models.packaged import ensure_packaged_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_builtin_model(model, Path(tmp)) if model == BENCH_MODEL_ID else \
            ensure_packaged_model(model, Path(tmp), cache=shared_cache())
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=_engine_stream, args=(model_dir, quantization, tokens, results))
        proc.start()
        count, wall, cpu = results.get(timeout=600)
        proc.join(60)
        return count / wall, 1000 * cpu / count


def sampler_node(nodes: list[LocalNode], instance_id: str) -> int:
    """The index of the node whose runner samples (the last rank): when it is not the API node (0), every token
    crosses zenoh, which moves CPU per token from one node to the other."""
    state = state_of(nodes[0]) or {}
    assignments = next(iter(state["instances"][instance_id].values()))["shardAssignments"]
    shards = assignments["runnerToShard"]
    rank = {runner: next(iter(shard.values()))["deviceRank"] for runner, shard in shards.items()}
    last = max(rank, key=lambda runner: rank[runner])
    node_id = next(node for node, runner in assignments["nodeToRunner"].items() if runner == last)
    return next(i for i, node in enumerate(nodes) if node.node_id == node_id)


def measure(nodes: list[LocalNode], ranks: int, tokens: int, streams: int, spy_dir: Path | None,
            quantization: str | None = None, model: str = BENCH_MODEL_ID, gil: bool = False
            ) -> tuple[float, dict[str, float], dict[str, list[tuple[float, str]]]]:
    """(tokens/s, CPU ms per token per process, top functions per process) of one placement's streams. One stream
    is timed, and its CPU read, from its first token to its last: the per-token path alone, without the request's
    admission and prefill; several are timed from sending them to the last token."""
    instance_id, runners = place_on(nodes[0], nodes[:ranks], nodes, quantization, model)
    try:
        sampler = sampler_node(nodes, instance_id)
        api = nodes[1 - sampler] if ranks > 1 else nodes[0]  # a Pipeline's tokens always cross zenoh to the API
        print(f"    sampler on node{sampler}, API on node{nodes.index(api)}", flush=True)
        pids = roles(nodes)
        if streams == 1:
            asyncio.run(_single(api.url, model, 8, pids))  # warm-up
        else:
            aggregate_decode(api, 8, streams, model)
        spies = spy(pids, spy_dir, gil) if spy_dir is not None else []
        if streams == 1:
            produced, seconds, before, after = asyncio.run(_single(api.url, model, tokens, pids))
            rate = produced / seconds
        else:
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            rate = aggregate_decode(api, tokens, streams, model)
            produced = tokens * streams  # greedy streams of a random model run to max_tokens
            after = {name: cpu_s(pid) for name, pid in pids.items()}
        tops: dict[str, list[tuple[float, str]]] = {}
        for name, proc, path in spies:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            proc.wait(30)
            tops[name] = top_functions(path, 8)
        per_token = {name: 1000 * (after[name] - before[name]) / produced for name in pids}
        return rate, per_token, tops
    finally:
        delete_instance(nodes[0], instance_id, runners)


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of a node onto `cores`; the runners it spawns later inherit them."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def start(root: Path, src: str | None, cores: list[set[int]] | None = None) -> tuple[Fleet, list[LocalNode]]:
    env = {"PYTHONPATH": os.path.abspath(src)} if src else {}
    fleet = Fleet(root, env={**env, "SKULK_SPECULATE": "0", "OMP_NUM_THREADS": "1",
                             "SKULK_MODEL_CACHE": str(shared_cache())})
    for index in range(2):
        fleet.nodes.append(fleet.spawn(index, [n.endpoint for n in fleet.nodes]))
        if cores:
            node = fleet.nodes[-1]
            assert node.process is not None
            pin(node.process.pid, cores[index % len(cores)])
    wait_until(lambda: all(n.node_id for n in fleet.nodes), 60, "two nodes to print ready")
    wait_until(lambda: formed(fleet.nodes), 60, "two nodes to form one cluster", poll=0.05)
    return fleet, fleet.nodes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spy", action="store_true", help="py-spy every process: top functions")
    parser.add_argument("--spy-keep", type=Path, help="copy py-spy's collapsed stacks into this folder")
    parser.add_argument("--spy-gil", action="store_true", help="py-spy only the GIL's holder: Python's own CPU")
    parser.add_argument("--src", action="append", default=[])
    parser.add_argument("--quantization", choices=["int4", "int8"], help="quantize the model at load")
    parser.add_argument("--ranks", default="1,2", help="placements to measure: 1 rank, Pipeline 2, or both")
    parser.add_argument("--model", choices=list(MODELS), default="bench")
    parser.add_argument("--cores", help="each node's cores (node0/node1), e.g. 0/1: a core per node, its runner too")
    parser.add_argument("--engine", action="store_true", help="also one stream with the engine driven directly")
    args = parser.parse_args()
    trees = args.src or [None]
    rank_counts = [int(r) for r in args.ranks.split(",")]
    model = str(MODELS[args.model])
    cores = [{int(c) for c in part.split(",")} for part in args.cores.split("/")] if args.cores else None
    alone = engine_alone(model, args.quantization, args.tokens) if args.engine else None
    with tempfile.TemporaryDirectory() as tmp:
        fleets = [start(Path(tmp) / f"tree{i}", src, cores) for i, src in enumerate(trees)]
        results: dict[tuple[int, int], list[tuple[float, dict[str, float]]]] = collections.defaultdict(list)
        try:
            for round_no in range(args.rounds):
                order = list(range(len(trees)))
                order = order if round_no % 2 == 0 else order[::-1]
                for ranks in rank_counts:
                    for tree in order:
                        spy_dir = Path(tmp) / f"spy{tree}-{ranks}-{round_no}" if args.spy else None
                        if spy_dir is not None:
                            spy_dir.mkdir()
                        rate, per_token, tops = measure(fleets[tree][1], ranks, args.tokens, args.streams, spy_dir,
                                                         args.quantization, model, args.spy_gil)
                        results[(tree, ranks)].append((rate, per_token))
                        if spy_dir is not None and args.spy_keep is not None:
                            shutil.copytree(spy_dir, args.spy_keep / spy_dir.name, dirs_exist_ok=True)
                        cells = "  ".join(f"{k} {v:5.2f}" for k, v in per_token.items())
                        print(f"round {round_no + 1} tree {tree} ranks {ranks}: {rate:6.1f} tok/s | CPU ms/token "
                              f"{cells} | load {os.getloadavg()[0]:.1f}", flush=True)
                        for name, top in tops.items():
                            print(f"    {name}: " + "; ".join(f"{share:.0%} {fn}" for share, fn in top[:6]))
        finally:
            for fleet, _ in fleets:
                fleet.stop_all()
    print(f"\nmedians over {args.rounds} rounds, {args.streams} streams x {args.tokens} tokens of {model}, "
          f"load {os.getloadavg()}")
    if alone is not None:
        print(f"  engine alone (one rank on core 0, one thread): {alone[0]:6.1f} tok/s, one stream | CPU ms/token "
              f"{alone[1]:5.2f}")
    for ranks in rank_counts:
        base = None
        for tree, src in enumerate(trees):
            rows = results[(tree, ranks)]
            rate = statistics.median(r for r, _ in rows)
            names = rows[0][1].keys()
            cpu = {n: statistics.median(p[n] for _, p in rows) for n in names}
            ratio = "" if base is None else f" ({rate / base:.2f} of tree 0)"
            if alone and ranks == 1 and args.streams == 1:
                ratio += f" ({rate / alone[0]:.2f} of the engine alone)"
            base = base or rate
            cells = "  ".join(f"{n} {v:5.2f}" for n, v in cpu.items())
            print(f"  {'1 rank' if ranks == 1 else 'Pipeline 2'} tree {tree} ({src or 'installed'}): "
                  f"{rate:6.1f} tok/s{ratio} | CPU ms/token {cells} | total {sum(cpu.values()):5.2f}")


if __name__ == "__main__":
    main()
