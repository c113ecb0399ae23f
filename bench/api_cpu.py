"""The API node's CPU per streamed token (issue 43's first target: <= 0.1 ms), at 1, 16 and 64 concurrent streams.

One node serving the ~100M bench model (bench/serving.py's); the runner is a child process, so the node
process's own CPU time (every thread: the loop, uvicorn, zenoh's runtime) is the API path's cost. What a request
costs once (its command, events, plan, template, HTTP headers) is divided out by difference: each round runs the
same streams twice, `--short` and `--long` tokens each, and a token's cost is (CPU of the long run - CPU of the
short one) ÷ (tokens of the long - tokens of the short), after the node's idle CPU over the same wall time
(heartbeats, info rounds) is taken away. Greedy, so every stream runs to its max_tokens. Rounds alternate which
length goes first; medians are printed with every round's figure. psutil reads CPU time in clock ticks (10 ms):
the long streams are long enough that a tick is a few per cent of the difference.

Measured 2026-12-08 02:30 UTC, quiet 2-core VM (load average 0.5, nothing else running), main at d1f220d:
  `--rounds 3 --streams 1,16`:        1 stream 0.437 ms (rounds 0.500, 0.437, 0.396); 16 streams 0.072 ms (0.072,
                                      0.076, 0.070)
  `--rounds 1 --streams 64 --long 256`: 64 streams 0.061 ms
So where tokens come in batches (16 and 64 streams: a step's tokens for all streams of the instance in one pipe
message, each stream's SSE writes coalesced while its client is behind) the API node spends 0.06-0.07 ms a token,
within the target; one stream alone, whose client keeps up, pays every hop per token: the pipe read and unpickle,
the stream's wake-up, the SSE event through the ASGI middleware chain and a socket write, 0.4-0.5 ms.

Run: .venv/bin/python bench/api_cpu.py [--rounds 3] [--short 32] [--long 512] [--streams 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from serving import api_stream, serving_node  # bench/serving.py (this script's folder is on the path)
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.runner.main import GOMP_SPINCOUNT


async def run_streams(url: str, tokens: int, streams: int) -> int:
    """Tokens produced by `streams` concurrent greedy streams of `tokens` each (one connection each)."""
    async def one() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return (await api_stream(client, tokens))[1]

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def busy_minus_idle(process: psutil.Process, url: str, tokens: int, streams: int) -> tuple[float, int]:
    """(the node's CPU seconds over the run less its idle CPU over as long, tokens produced)."""
    before, start = cpu_seconds(process), time.perf_counter()
    produced = asyncio.run(run_streams(url, tokens, streams))
    busy, wall = cpu_seconds(process) - before, time.perf_counter() - start
    before = cpu_seconds(process)
    time.sleep(wall)
    return busy - (cpu_seconds(process) - before), produced


def per_token_ms(process: psutil.Process, url: str, streams: int, short: int, long: int, first_long: bool) -> float:
    runs = {}
    for tokens in ((long, short) if first_long else (short, long)):
        runs[tokens] = busy_minus_idle(process, url, tokens, streams)
    (cpu_long, n_long), (cpu_short, n_short) = runs[long], runs[short]
    return (cpu_long - cpu_short) * 1000 / max(n_long - n_short, 1)


def main() -> None:
    if "GOMP_SPINCOUNT" not in os.environ:  # the runner's spin, as in bench/serving.py
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GOMP_SPINCOUNT": GOMP_SPINCOUNT})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--long", type=int, default=512)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--quantization", choices=["int4", "int8"], default="int4")
    args = parser.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ensure_builtin_model(BENCH_MODEL_ID, root / "node" / "models")
        with serving_node(root, args.quantization) as node:
            assert node.process is not None
            process = psutil.Process(node.process.pid)
            asyncio.run(run_streams(node.url, 8, 4))  # connections, caches and the runner warm before measuring
            print(f"model {BENCH_MODEL_ID} ({args.quantization}), {args.short} vs {args.long} tokens a stream, "
                  f"load average {os.getloadavg()[0]:.1f}")
            for streams in counts:
                figures = [per_token_ms(process, node.url, streams, args.short, args.long, first_long=i % 2 == 1)
                           for i in range(args.rounds)]
                print(f"{streams:3d} streams: API node CPU per token {statistics.median(figures):.3f} ms "
                      f"(target <= 0.1; rounds {', '.join(f'{f:.3f}' for f in figures)})", flush=True)


if __name__ == "__main__":
    main()
