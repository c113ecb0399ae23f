"""TLS on ÷ off for streaming decode through the API (issue 44: target ≥ 0.97), side by side in one run.

Two nodes on this machine, each with its own instance of the ~100M random Llama (bench/serving.py's model): one
serves plain http, one https with a self-signed pair (`skulk tls self-signed`). Each round streams one greedy
request from each, the order swapped every round, so machine noise hits both alike; the node not being measured
sits idle. Prints per round and as medians: decode tok/s (first token to last) and TTFT for each, and the ratios
TLS ÷ plain (decode: higher is better; TTFT: the extra milliseconds of TLS).

`--control` runs the same with both nodes on plain http (an A/A run): the ratio then says how far two nodes of
this machine differ with no TLS at all, which bounds what the TLS ratio can tell.

Run: .venv/bin/python bench/tls.py [--tokens 64] [--rounds 5] [--control]

Measured on this 2-core machine, quiet, 2026-12-06 20:55 UTC, `--rounds 7 --tokens 64`: TLS ÷ plain 1.097 (TTFT
+1.9 ms); the A/A control right after, 1.046 (the second node is the faster alone). TLS costs nothing this run can
see: within the 5 % two plain nodes already differ by, and above the 0.97 target either way.
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

from serving import (  # bench/serving.py (this script's folder is on the path): one timed stream
    api_stream,
    place_and_wait,
)
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.runner.main import GOMP_SPINCOUNT
from skulk.testing.nodes import LocalNode
from skulk.tls import write_pair


def start(root: Path, name: str, tls: tuple[Path, Path] | None) -> LocalNode:
    """A node of its own cluster with the bench model placed and ready."""
    ensure_builtin_model(BENCH_MODEL_ID, root / name / "models")
    node = LocalNode(home=root / name, cluster=f"tls{name}{int(time.time())}", tls=tls).start().wait_ready()
    return place_and_wait(node, {"model_id": BENCH_MODEL_ID})


async def one(node: LocalNode, tokens: int) -> tuple[float, float]:
    """(decode tok/s, TTFT s) of one streamed greedy request to this node."""
    async with httpx.AsyncClient(base_url=node.url, verify=node.verify, timeout=300) as client:
        ttft, produced, first, last = await api_stream(client, tokens)
    return (produced - 1) / max(last - first, 1e-9), ttft


def measure(plain: LocalNode, secure: LocalNode, tokens: int, rounds: int) -> None:
    for node in (plain, secure):  # warm each path: connections, the runner's first decode
        asyncio.run(one(node, tokens))
    ratios, extra_ms = [], []
    print(f"{'round':>5} {'plain tok/s':>12} {'tls tok/s':>10} {'tls÷plain':>10} {'TTFT plain':>11} {'TTFT tls':>9}")
    for r in range(rounds):
        order = (plain, secure) if r % 2 == 0 else (secure, plain)
        got = {id(node): asyncio.run(one(node, tokens)) for node in order}
        (p_tps, p_ttft), (s_tps, s_ttft) = got[id(plain)], got[id(secure)]
        ratios.append(s_tps / p_tps)
        extra_ms.append((s_ttft - p_ttft) * 1e3)
        print(f"{r:>5} {p_tps:>12.1f} {s_tps:>10.1f} {ratios[-1]:>10.3f} {p_ttft * 1e3:>9.1f}ms {s_ttft * 1e3:>7.1f}ms")
    print(f"median TLS ÷ plain decode tok/s: {statistics.median(ratios):.3f}  (target ≥ 0.97)")
    print(f"median TTFT with TLS - without: {statistics.median(extra_ms):+.1f} ms")


def main() -> None:
    if "GOMP_SPINCOUNT" not in os.environ:  # as bench/serving.py: the runners spin as they do in production
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GOMP_SPINCOUNT": GOMP_SPINCOUNT})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--control", action="store_true",
                        help="A/A: the second node serves plain http too, to see how far two nodes differ alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pair = write_pair(root / "tls", ["localhost"])
        nodes: list[LocalNode] = []
        try:
            nodes.append(start(root, "plain", None))
            nodes.append(start(root, "secure", None if args.control else pair))
            measure(nodes[0], nodes[1], args.tokens, args.rounds)
        except BaseException:
            for node in nodes:
                print(f"---- {node.home.name} output ----\n{node.log_tail(40)}")
            raise
        finally:
            for node in nodes:
                node.stop()
                node.reap_leftovers()


if __name__ == "__main__":
    main()
