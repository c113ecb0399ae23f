"""The engine's scheduling, measured side by side in one run on the ~100M random Llama (CPU, in-process).

Prints, per round and as medians:
  chunked prefill: while a 2,000-token prompt is prefilled beside 4 running streams, their largest (and median)
    gap between tokens ÷ their normal step time (target < 3), against what one whole prefill would stall them
    for (a decode step plus the prompt's prefill timed alone on the same engine)
  prefix reuse: the second turn's time to first token ÷ the first turn's, for a 1,000-token history (target
    ≤ 0.3), against the same second turn on an engine that starts cold
  a burst: 8 chat-sized prompts (64 tokens) arriving together at an idle engine, the time until the last of them
    has its first token and the steps it took, admitted together (up to wire.MAX_ADMITS per step) ÷ one admission
    per step (schedule.MAX_ADMITS set to 1 for the comparison)

The running streams are kept going by the engine's test hook (they emit a fixed token instead of sampling, so
none ends early on an end-of-sequence token of the random model); the measured prompt is sampled normally.

Run: .venv/bin/python bench/scheduling.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from skulk.engines.torch import schedule
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.types.chat import SamplingParams

STREAMS = 4
LONG_PROMPT = 2000
HISTORY = 1000
BURST, BURST_PROMPT = 8, 64


def words(n: int, rng: random.Random) -> list[int]:
    return [258, *(rng.randrange(32, 127) for _ in range(n - 1))]


def keep_streams_going(where: str, req: Any) -> int | None:
    return 65 if where == "sample" and req.request_id.startswith("s") else None


def whole_prefill(model_dir: Path, rng: random.Random) -> float:
    """Seconds to prefill the long prompt in one step, nothing else running."""
    engine = TorchEngine(model_dir, max_seq=2048, prefill_chunk=LONG_PROMPT)
    engine.add_request("warm", words(64, rng), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work():
        engine.step()
    engine.add_request("long", words(LONG_PROMPT, rng), SamplingParams(max_tokens=1, temperature=0))
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def gap_ratio(model_dir: Path, rng: random.Random) -> tuple[float, float, float]:
    """(largest and median gap of a running stream during the long prefill, its median gap before), seconds."""
    engine = TorchEngine(model_dir, max_seq=2048)
    engine.fault_hook = keep_streams_going
    for i in range(STREAMS):
        engine.add_request(f"s{i}", words(16, rng), SamplingParams(max_tokens=1500, temperature=0))
    stamps: list[float] = []
    seen: set[str] = set()

    def step_until(done: Any) -> None:
        while not done():
            outs = engine.step()
            seen.update(o.request_id for o in outs)
            if any(o.request_id == "s0" for o in outs):
                stamps.append(time.perf_counter())

    step_until(lambda: len(stamps) >= 24)
    normal = statistics.median(b - a for a, b in itertools.pairwise(stamps[4:]))
    stamps.clear()
    engine.add_request("long", words(LONG_PROMPT, rng), SamplingParams(max_tokens=1, temperature=0))
    before = time.perf_counter()
    stamps.append(before)
    step_until(lambda: "long" in seen)
    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return max(gaps), statistics.median(gaps), normal


def ttft(engine: TorchEngine, rid: str, prompt: list[int]) -> tuple[float, list[int]]:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=0))
    started = time.perf_counter()
    first = 0.0
    reply: list[int] = []
    while engine.has_work():
        outs = engine.step()
        if outs and not first:
            first = time.perf_counter() - started
        reply += [o.token_id for o in outs]
    return first, reply


def reuse_ratio(model_dir: Path, rng: random.Random) -> tuple[float, float, float]:
    """(first turn TTFT, second turn TTFT with reuse, the same second turn cold) in seconds."""
    engine = TorchEngine(model_dir, max_seq=2048)
    history = words(HISTORY, rng)
    first, reply = ttft(engine, "t1", history)
    second_prompt = [*history, *reply, *words(24, rng)[1:]]
    second, _ = ttft(engine, "t2", second_prompt)
    cold_engine = TorchEngine(model_dir, max_seq=2048)
    cold, _ = ttft(cold_engine, "t2", second_prompt)
    return first, second, cold


@contextlib.contextmanager
def admits_per_step(n: int) -> Iterator[None]:
    saved = schedule.MAX_ADMITS
    schedule.MAX_ADMITS = n
    try:
        yield
    finally:
        schedule.MAX_ADMITS = saved


def burst(engine: TorchEngine, rng: random.Random) -> tuple[float, int]:
    """(seconds, steps) until every prompt of a burst arriving at once has its first token."""
    waiting = {f"b{i}" for i in range(BURST)}
    for rid in waiting:
        engine.add_request(rid, words(BURST_PROMPT, rng), SamplingParams(max_tokens=16, temperature=0))
    started, steps = time.perf_counter(), 0
    while waiting:
        waiting -= {o.request_id for o in engine.step()}
        steps += 1
    elapsed = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    return elapsed, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_builtin_model(BENCH_MODEL_ID, Path(tmp))
        chunked, typical, whole, reuse, cold, bursts = [], [], [], [], [], []
        engine = TorchEngine(model_dir, max_seq=2048)
        burst(engine, rng)  # warm
        for round_ in range(args.rounds):
            largest, median, normal = gap_ratio(model_dir, rng)
            alone = whole_prefill(model_dir, rng)
            chunked.append(largest / normal)
            typical.append(median / normal)
            whole.append((normal + alone) / normal)
            print(f"round {round_}: normal step {normal * 1000:6.1f} ms; during the prefill largest gap "
                  f"{largest * 1000:7.1f} ms, median {median * 1000:6.1f} ms; whole prefill {alone * 1000:7.1f} ms")
            first, second, cold_second = reuse_ratio(model_dir, rng)
            reuse.append(second / first)
            cold.append(cold_second / first)
            print(f"round {round_} reuse: first turn TTFT {first * 1000:7.1f} ms, second {second * 1000:6.1f} ms "
                  f"(cold {cold_second * 1000:7.1f} ms)")
            together, steps = burst(engine, rng)
            with admits_per_step(1):
                one_by_one, single_steps = burst(engine, rng)
            bursts.append(together / one_by_one)
            print(f"round {round_} burst of {BURST}: last first token after {together * 1000:6.1f} ms in {steps} "
                  f"steps (one admission per step: {one_by_one * 1000:6.1f} ms in {single_steps} steps)")
        print(f"\nlargest gap ÷ normal step during a {LONG_PROMPT}-token prefill beside {STREAMS} streams: "
              f"largest {statistics.median(chunked):.2f} (target < 3), median {statistics.median(typical):.2f}; "
              f"a whole prefill would be {statistics.median(whole):.2f}")
        print(f"second turn TTFT ÷ first for a {HISTORY}-token history: reused {statistics.median(reuse):.2f} "
              f"(target ≤ 0.3), cold {statistics.median(cold):.2f}")
        print(f"a burst of {BURST} {BURST_PROMPT}-token prompts, time to the last first token: admitted together ÷ "
              f"one per step {statistics.median(bursts):.2f}")


if __name__ == "__main__":
    main()
