"""What splitting costs and gains inside the engine alone: 1 rank on one core against Pipeline 2 and Tensor 2 on two
cores (one compute thread per rank), over gloo on loopback with an emulated link latency, without the node path.

bench/split.py measures whole nodes (API, runner, supervisor, zenoh, SSE) in network namespaces; on a machine with
one core per node, that path shares the rank's core and dominates at 8 streams. This bench drives TorchEngine ranks
directly (rank 0's script steps the engine; later ranks step until it closes), each process pinned to its core, so
the figures are the engine's: single-stream decode tok/s, the 8-stream aggregate (all 8 decoding), TTFT (one stream,
prompt to first token), and the CPU every rank together spent per token of the 8 streams (process CPU time, all
threads: on a shared machine the wall-clock rates follow the load, this does not; "busiest": the rank that spent
the most, which sets a micro-batched round where each rank has its own core). --forced adds Pipeline 2 with
micro-batches off and always on beside Pipeline 2 as the engine decides (engines/micro_batching.py).
Speculative decoding is off everywhere (a split never speculates: like for like). Latency:
SKULK_LINK_DELAY_MS (engines/torch/delay.py) at RTT/2, default 0.5 ms RTT. Placements alternate (1, P2, T2, 1, P2,
T2, ...) so a load that drifts (a shared machine) hits each alike; each ratio is medians over the rounds, and each
round's own ratios are printed beside them (a load spike in one placement's turn shows as one outlying round).
Tensor 2 is skipped for a model whose heads do not split in two (SmolLM2: 9 heads). Pipeline ranks get the layers
placement gives two like nodes (shard_plan.plan_ring: balanced by decode work, the lm_head on the last rank; the
ranges are printed); --halves adds Pipeline 2 on equal layer counts, the split before that balance, in the same
rounds.

Measured 2026-11-26, quiet 2-core VM (load 1.1-1.5), ÷ one rank, one stream / 8 streams / CPU per token: 100M int4
Pipeline 2 as decided (2 micro-batches) 0.60 / 0.82 / 1.96, plain 0.59 / 0.82 / 1.20, always 0.66 / 1.03 / 1.55,
Tensor 2 0.06 / 0.15 / 7.45 (1 round); SmolLM2 Pipeline 2 0.95 / 0.96 / 1.63 (3 rounds: 0.81, 1.12, 0.95), plain
1.05 / 0.96 / 1.03, always 0.83 / 0.87 / 1.73 (1 round). --rows (load ~3.7): t(8)/t(4) 1.32 (100M int4), 1.38
(SmolLM2), so 8 streams over two ranks can gain at most that: the issue's 1.6x needs t(R)/t(R/2) >= 1.6, which
SmolLM2 reaches at 16 rows (1.69).

Placement's balanced split (SmolLM2: 22 + 8 layers, the 30 MB head on rank 1) against equal halves, 2026-11-26,
quiet 2-core VM (load 1.4-1.8), --halves --rounds 3 --tokens 160: 8 streams 712.5 against 580.8 tok/s (1.23; each
round 1.20 / 1.15 / 1.27), the busiest rank's CPU 1.37 against 1.60 ms a token (halves: rank 0 1.03-1.16, rank 1
1.59-1.99); one stream 129.5 against 128.5 (1.01); TTFT 15.4 against 12.4 ms (rank 0 prefills 22 layers; --layers
8,22 reads 14.4-14.9, so TTFT follows rank 0's layers). --layers 21,9 measured 1.22-1.29 ms on its busiest rank
against 22/8's 1.26-1.43 (rank 0's own work per step, besides its layers, is not in placement's bytes). Again with
rank 0's pace counting the head (3ea756c; load 1.0-1.3): 8 streams 659.1 against 472.5 (1.39; rounds 1.15 / 1.49 /
1.50), 1.36 x one rank; one stream 102.5 against 107.9 (rounds 0.95 / 1.02 / 1.07); TTFT 17.7 against 16.1 ms.

Run: .venv/bin/python bench/split_engine.py [--models bench,smollm2] [--rtt-ms 0.5] [--rounds 2] [--tokens 48]
     [--forced] [--halves [--layers 21,9]]
     .venv/bin/python bench/split_engine.py --rows 1,2,4,8,16   (t(R): one rank's step and forward CPU by rows)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = {"bench": ("skulk/bench-random-100m", "int4"), "smollm2": ("", None),  # "": packaged.DEFAULT_MODEL_ID
          "bench700m": ("skulk/bench-random-700m", "int4")}
PLACEMENTS = (("1 rank", 1, "pipeline"), ("Pipeline 2", 2, "pipeline"), ("Tensor 2", 2, "tensor"))
FORCED = (("P2 plain", 2, "plain"), ("P2 always", 2, "always"))
"""--forced: Pipeline 2 without micro-batches and with them always (engine.micro_batches False / True), beside
Pipeline 2 as the engine decides (micro_batching's rule, from its measured pace)."""
HALVES = ("P2 halves", 2, "halves-pipeline")
"""--halves: Pipeline 2 on equal layer counts beside Pipeline 2 on placement's split, in the same rounds."""
STREAMS = 8
PROMPT = b"Write a short story about a fox who learns to split a model across two machines. "


class Clocked:
    """A rank's (wall, process CPU) after every step: the CPU any window of rank 0's costs this rank."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.samples = engine, [(time.perf_counter(), time.process_time())]

    def step(self) -> None:
        self.engine.step()
        self.engine.take_events()
        self.samples.append((time.perf_counter(), time.process_time()))


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """Process CPU seconds a rank spent between two wall times (its samples nearest inside the window)."""
    inside = [c for t, c in samples if start <= t <= end]
    return inside[-1] - inside[0] if len(inside) > 1 else 0.0


def run_streams(engine: Clocked, streams: int, tokens: int, tag: str
                ) -> tuple[float, float, tuple[float, float, int], tuple[float, tuple[float, float, int]]]:
    """(decode tok/s while all `streams` decode, ms from admission to the first token of the first stream, the
    window's (start, end, tokens), and (the streams' steady aggregate as bench/split.py counts it through nodes:
    the sum of each stream's own rate, its tokens after the first over its first-to-last-token time; and the
    whole run's (start, end, tokens), admission to the last step, as split.py reads a node process's CPU))."""
    from skulk.types.chat import SamplingParams

    greedy = SamplingParams(max_tokens=tokens, temperature=0)
    for i in range(streams):
        engine.engine.add_request(f"{tag}-{i}", [*PROMPT, *f"({i})".encode()], greedy)
    sent, first, start = time.perf_counter(), 0.0, None
    seen: dict[str, Any] = {}  # request id -> request, kept after it leaves the running rows
    marks: dict[str, list[float]] = {}  # request id -> [first token's time, tokens then, last token's time, tokens]
    end: tuple[float, int] | None = None

    def mark() -> None:
        now = time.perf_counter()
        for r in engine.engine._running:
            seen.setdefault(r.request_id, r)
        for rid, r in seen.items():
            count = len(r.emitted)
            got = marks.get(rid)
            if count and got is None:
                marks[rid] = [now, count, now, count]
            elif got is not None and count > got[3]:
                got[2:] = [now, count]

    while True:
        engine.step()
        mark()
        running = engine.engine._running
        emitted = [len(r.emitted) for r in running]
        if not first and any(emitted):
            first = time.perf_counter() - sent
        if start is None and len(running) == streams and min(emitted) >= 1:
            start = (time.perf_counter(), sum(emitted))
        if start is not None and end is None and max(emitted, default=tokens) >= tokens - 2:
            end = (time.perf_counter(), sum(emitted))
        if end is not None and not (engine.engine._adds or engine.engine._pending or engine.engine._running):
            break
    assert start is not None and end is not None
    steady = sum((m[3] - m[1]) / (m[2] - m[0]) for m in marks.values() if m[2] > m[0])
    whole = (sent, time.perf_counter(), sum(int(m[3]) for m in marks.values()))
    return (end[1] - start[1]) / (end[0] - start[0]), first * 1000, (start[0], end[0], end[1] - start[1]), \
        (steady, whole)


def rank_main(model_dir: Path, quant: str | None, rank: int, world: int, kind: str, layers: list[tuple[int, int]],
              port: int, tokens: int, results: Any) -> None:
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    import torch

    from skulk.engines.torch.engine import TorchEngine

    torch.set_num_threads(1)
    if world == 1:
        engine = TorchEngine(model_dir, quantize=quant, speculate=False)
    else:
        from skulk.models.demo import demo_card
        from skulk.runner.group import connect_group
        from skulk.runner.recorder import FlightRecorder
        from skulk.runner.spec import RunnerSpec
        from skulk.types.ids import InstanceId, NodeId, RunnerId
        from skulk.types.instances import Rendezvous, Sharding
        from skulk.types.shards import PipelineShardMetadata, TensorShardMetadata

        start, end = layers[rank]
        forced, kind = {"plain": False, "always": True}.get(kind), "pipeline" if kind in ("plain", "always") else kind
        shard_type = TensorShardMetadata if kind == "tensor" else PipelineShardMetadata
        shard = shard_type(model_card=demo_card(), device_rank=rank, world_size=world, start_layer=start,
                           end_layer=end, n_layers=layers[-1][1])
        spec = RunnerSpec(node_id=NodeId(f"n{rank}"), runner_id=RunnerId(f"r{rank}"), instance_id=InstanceId("i"),
                          shard=shard, sharding=Sharding.Tensor if kind == "tensor" else Sharding.Pipeline,
                          model_dir=model_dir, rendezvous=Rendezvous(host="127.0.0.1", port=port))
        group = connect_group(spec, FlightRecorder(spec.context(os.getpid()), enabled=False))
        engine = TorchEngine(model_dir, rank=rank, world_size=world, kind=kind,  # type: ignore[arg-type]
                             start_layer=start, end_layer=end, control_group=group.control, quantize=quant)
        group.wait_all_loaded(120)
        engine.micro_batches = forced
    engine.warmup()
    if os.environ.get("SKULK_BENCH_FIFO"):  # split_rows.py: SCHED_FIFO once warm, as it puts the nodes
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(10))
    clocked = Clocked(engine)
    if rank == 0:
        run_streams(clocked, 2, 8, "warm")
        single, ttft, one, _ = run_streams(clocked, 1, tokens, "one")
        aggregate, _, window, steady = run_streams(clocked, STREAMS, tokens, "many")
        if world > 1 and kind == "pipeline" and engine.micro_batches is None:
            print(f"    the rule keeps {engine.micro} micro-batch(es) in flight at 8 streams", flush=True)
        results.put((0, (single, ttft, aggregate, window, one, steady, engine.micro if world > 1 else 1)))
        engine.close()
    else:
        while not engine.closed:
            clocked.step()
    results.put((rank, clocked.samples))


def placed_card(model_id: str, quant: str | None) -> Any:
    """The card placement plans this model with (quantized at load as the bench runs it)."""
    from skulk.models.cards import get_card, with_quantization

    return with_quantization(get_card(model_id), quant)  # type: ignore[arg-type]


def pipeline_ranges(card: Any, world: int, halves: bool) -> list[tuple[int, int]]:
    """The layers placement gives each rank of a Pipeline over `world` like nodes with room to spare
    (shard_plan.plan_ring, as master/placement.py calls it: the split balanced by decode work, the head on the last
    rank); halves: equal layer counts instead (the split before the balance)."""
    from skulk.master.shard_plan import allocate_layers, layer_ranges, plan_ring
    from skulk.types.ids import NodeId
    from skulk.types.instances import Sharding

    if halves:
        forced = os.environ.get("SKULK_BENCH_LAYERS")  # --layers: counts per rank instead of equal ones
        return layer_ranges([int(c) for c in forced.split(",")] if forced else allocate_layers(card.n_layers,
                                                                                                 [1] * world))
    plans = plan_ring(card, Sharding.Pipeline, [NodeId(f"n{r}") for r in range(world)], [64 << 30] * world)
    return [(p.start_layer, p.end_layer) for p in plans]


def measure(model_dir: Path, quant: str | None, card: Any, world: int, kind: str, tokens: int
            ) -> tuple[float, float, float, float, float]:
    """(single tok/s, TTFT ms, 8-stream tok/s, CPU ms per token of all ranks together in the 8-stream window, and
    of the busiest rank: with micro-batches in flight, what sets the round where each rank has its own core)."""
    return measure_detail(model_dir, quant, card, world, kind, tokens)["figures"]


def measure_detail(model_dir: Path, quant: str | None, card: Any, world: int, kind: str, tokens: int
                   ) -> dict[str, Any]:
    """measure's figures, with the 8 streams' steady aggregate as bench/split.py counts it (`steady`), each rank's
    CPU ms per token over the whole 8-stream run, admission to the last step, as bench/split.py reads a node's
    processes (`ranks`), and the micro-batches rank 0 kept in flight (`micro`)."""
    from skulk.testing.nodes import free_port

    layers = pipeline_ranges(card, world, halves=kind.startswith("halves"))
    kind = kind.removeprefix("halves-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(model_dir, quant, r, world, kind, layers, port, tokens, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < world + 1:  # rank 0's figures, then every rank's clock samples
            try:
                rank, payload = results.get(timeout=1)
                got[rank if rank not in got else -1 - rank] = payload
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
        single, ttft, aggregate, (start, end, count), one, (steady, whole), micro = got[0]
        samples = [got[-1]] + [got[r] for r in range(1, world)]
        alone = sum(cpu_between(s, one[0], one[1]) for s in samples) * 1000 / one[2]
        print(f"    one stream: every rank's CPU per token {alone:.2f} ms", flush=True)
        cpu = [cpu_between(s, start, end) for s in samples]
        print(f"    {layers}: each rank's CPU per token {' / '.join(f'{c * 1000 / count:.2f}' for c in cpu)} ms",
              flush=True)
        spent = [cpu_between(s, whole[0], whole[1]) * 1000 / max(whole[2], 1) for s in samples]
        return {"figures": (single, ttft, aggregate, sum(cpu) * 1000 / count, max(cpu) * 1000 / count),
                "steady": steady, "ranks": spent, "micro": micro}
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def forward_by_rows(model_dir: Path, quant: str | None, counts: list[int], results: Any) -> None:
    """t(R): one rank on one core with one thread, CPU seconds of a decode step of R rows (median of the steady
    steps) and of its forward alone, for each R; what micro_batching's rule weighs (t(R/2) against t(R))."""
    os.sched_setaffinity(0, {0})
    import torch

    from skulk.engines.torch.engine import TorchEngine
    from skulk.types.chat import SamplingParams

    torch.set_num_threads(1)
    engine = TorchEngine(model_dir, quantize=quant, speculate=False)
    engine.warmup()
    model, forwards = engine.model, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        out = model(*args, **kwargs)
        forwards.append(time.thread_time() - started)
        return out

    engine.model = timed  # type: ignore[assignment]  # the engine only calls it (and reads args, below)
    timed.args = model.args  # type: ignore[attr-defined]
    for rows in counts:
        greedy = SamplingParams(max_tokens=40, temperature=0)
        for i in range(rows):
            engine.add_request(f"r{rows}-{i}", [*PROMPT, *f"({i})".encode()], greedy)
        steps: list[tuple[float, float]] = []
        while engine._adds or engine._pending or engine._running:
            before, started = len(forwards), time.thread_time()
            engine.step()
            engine.take_events()
            spent = time.thread_time() - started
            decoding = len(engine._running) == rows and all(r.length >= len(r.prompt) for r in engine._running)
            if decoding and len(forwards) == before + 1:
                steps.append((spent, forwards[-1]))
        steady = steps[3:-3] or steps
        results.put((rows, statistics.median(s for s, _ in steady), statistics.median(f for _, f in steady)))
    results.put(None)


def print_forwards(key: str, model_dir: Path, quant: str | None, counts: list[int]) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=forward_by_rows, args=(model_dir, quant, counts, results))
    proc.start()
    got = []
    while (item := results.get(timeout=600)) is not None:
        got.append(item)
    proc.join(60)
    base = dict((rows, step) for rows, step, _ in got)
    for rows, step, forward in got:
        half = base.get(rows // 2)
        gain = f"  t(R)/t(R/2) {step / half:4.2f}" if half else ""
        print(f"{key:8} R={rows:3d}  step {step * 1000:7.2f} ms CPU  forward {forward * 1000:7.2f} ms  "
              f"per row {step * 1000 / rows:6.2f} ms{gain}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench,smollm2")
    parser.add_argument("--rtt-ms", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--forced", action="store_true", help="also Pipeline 2 with micro-batches off and always on")
    parser.add_argument("--halves", action="store_true",
                        help="also Pipeline 2 on equal layer counts (the split before placement balanced the work)")
    parser.add_argument("--layers", help="with --halves: these layer counts per rank instead (e.g. 21,9)")
    parser.add_argument("--rows", help="instead: t(R), one rank's step and forward CPU at these row counts (1,2,4,8)")
    args = parser.parse_args()
    if args.layers:
        os.environ["SKULK_BENCH_LAYERS"] = args.layers
    os.environ["SKULK_LINK_DELAY_MS"] = f"{args.rtt_ms / 2:g}"  # the ranks inherit it (engines/torch/delay.py)
    from transformers import AutoConfig

    from skulk.models.demo import BUILTIN_MODELS, ensure_builtin_model
    from skulk.models.packaged import DEFAULT_MODEL_ID, ensure_packaged_model, shared_cache

    load = [os.getloadavg()[0]]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            model_id, quant = MODELS[key]
            model_id = model_id or DEFAULT_MODEL_ID
            model_dir = ensure_builtin_model(model_id, Path(tmp)) if model_id in BUILTIN_MODELS else \
                ensure_packaged_model(model_id, Path(tmp), cache=shared_cache())
            if args.rows:
                print_forwards(key, model_dir, quant, [int(r) for r in args.rows.split(",")])
                continue
            config = AutoConfig.from_pretrained(model_dir)
            card = placed_card(model_id, quant)
            heads = (config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 0)
            placements = [p for p in PLACEMENTS if p[2] != "tensor" or all(h % p[1] == 0 for h in heads)]
            placements += list(FORCED) if args.forced else []
            placements += [HALVES] if args.halves else []
            print(f"  {key:8} Pipeline 2 layers {pipeline_ranges(card, 2, False)} (halves: "
                  f"{pipeline_ranges(card, 2, True)})", flush=True)
            got: dict[str, list[tuple[float, float, float, float, float]]] = {label: [] for label, _, _ in placements}
            for _ in range(args.rounds):
                for label, world, kind in placements:
                    got[label].append(measure(model_dir, quant, card, world, kind, args.tokens))
                    load.append(os.getloadavg()[0])
                    print(f"  {key:8} {label:10} single {got[label][-1][0]:7.1f}  ttft {got[label][-1][1]:7.1f} ms"
                          f"  8-stream {got[label][-1][2]:7.1f}  cpu {got[label][-1][3]:5.2f} ms/token (busiest rank "
                          f"{got[label][-1][4]:5.2f})", flush=True)
            base = [statistics.median(x[i] for x in got["1 rank"]) for i in range(5)]
            for label, _, _ in placements:
                med = [statistics.median(x[i] for x in got[label]) for i in range(5)]
                pairs = zip(got[label], got["1 rank"], strict=True)
                rounds = " ".join(f"{x[0] / one[0]:.2f}/{x[2] / one[2]:.2f}" for x, one in pairs)
                lines.append(f"{key:8} {label:10} | {med[0]:7.1f} {med[0] / base[0]:5.2f} | {med[1]:7.1f} "
                             f"{med[1] / base[1]:5.2f} | {med[2]:7.1f} {med[2] / base[2]:5.2f} | {med[3]:6.2f} "
                             f"{med[3] / base[3]:5.2f} | {med[4]:6.2f} {med[4] / base[4]:5.2f} | {rounds}")
    if args.rows:
        print(f"one rank, one thread on core 0, CPU time (thread clock); load average (1 min) {os.getloadavg()[0]:.1f}")
        return
    print(f"\nengine only, one thread per rank on its own core, {args.rtt_ms} ms RTT emulated, speculation off, "
          f"{args.tokens} tokens, medians of {args.rounds} alternating rounds; load average (1 min) "
          f"{min(load):.1f}-{max(load):.1f}")
    print(f"{'model':8} {'placement':10} | {'single':>7} {'÷1':>5} | {'ttft ms':>7} {'÷1':>5} | {'8-str':>7} {'÷1':>5} "
          f"| {'cpu/tok':>6} {'÷1':>5} | {'busiest':>6} {'÷1':>5} | rounds' single/8-str ÷1 (same round's 1 rank)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
