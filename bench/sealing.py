"""What sealing the cluster costs: decode tokens/s and TTFT with a cluster key ÷ without, on 2 nodes (CPU).

Two 2-node clusters run side by side, one started with a cluster key and one without, each with the bench model
placed on one node; every request goes to the *other* node, so the command, the prompt payload and every token
chunk cross zenoh between nodes (sealed in one cluster, plain in the other). Requests alternate between the
clusters so machine noise hits both alike.

  decode tok/s sealed ÷ open   (target >= 0.98)
  TTFT sealed - open           (target <= +2 ms)

Run: .venv/bin/python bench/sealing.py [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from skulk.cluster.seal import Sealer, generate_key
from skulk.models.demo import BENCH_MODEL_ID
from skulk.testing.cluster import Cluster
from skulk.testing.convergence import formed
from skulk.testing.nodes import LocalNode
from skulk.testing.waiting import wait_until

PROMPT = "Benchmark the serving path of a distributed inference cluster, please."


async def api_single(url: str, tokens: int, model: str) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s from first to last token) of one greedy streamed request."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    produced = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        sent = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if payload.get("choices") == [] and "usage" in payload:
                    produced = payload["usage"]["completion_tokens"]
                    continue
                last = time.perf_counter()
                first = first or last
    return first - sent, (produced - 1) / max(last - first, 1e-9)


def seal_cost_us(size: int = 200, count: int = 20000) -> float:
    """Microseconds to seal and open one message of `size` bytes (a token chunk is ~200), in-process."""
    alice = Sealer.from_cluster_key(generate_key())
    bob = Sealer(alice.key)
    payload = b"x" * size
    start = time.perf_counter()
    for _ in range(count):
        bob.open("skulk/c/data/x", alice.seal("skulk/c/data/x", payload))
    return (time.perf_counter() - start) / count * 1e6


def placed_far(nodes: list[LocalNode], model: str) -> str:
    """Place the bench model on one node; return the URL of the other node, the one requests go to."""
    with nodes[0].client(timeout=120) as client:
        reply = client.post("/place_instance", json={"model_id": model})
        reply.raise_for_status()
        instance_id = reply.json()["instanceId"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            state = client.get("/state").json()
            shards = state["instances"][instance_id]["MlxRingInstance"]["shardAssignments"]
            runners = list(shards["runnerToShard"])
            if all("RunnerReady" in state["runners"].get(r, {}) for r in runners):
                hosts = set(shards["nodeToRunner"])
                return next(n.url for n in nodes if n.node_id not in hosts)
            time.sleep(0.5)
    raise RuntimeError("bench instance did not become ready")


def start(root: Path, name: str, env: dict[str, str], model: str) -> tuple[Cluster, str]:
    cluster = Cluster(root / name, prefix=name, extra_env=env)
    nodes = cluster.start(2)
    wait_until(lambda: formed(nodes), 120, "2 nodes to form")
    return cluster, placed_far(nodes, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--control", action="store_true", help="A/A run: neither cluster sealed, to see how far "
                        "two identical clusters differ on this machine")
    parser.add_argument("--model", default=BENCH_MODEL_ID, help="e.g. skulk/tiny-random-llama: a fast model, "
                        "so the per-message cost of sealing is a larger share of each token")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        clusters: list[Cluster] = []
        try:
            key = {} if args.control else {"SKULK_CLUSTER_KEY": generate_key()}
            sealed, sealed_url = start(root, "sealed", key, args.model)
            clusters.append(sealed)
            plain, plain_url = start(root, "open", {}, args.model)
            clusters.append(plain)
            measure(sealed_url, plain_url, args.tokens, args.rounds, args.model)
        finally:
            for cluster in clusters:
                cluster.stop_all()


def measure(sealed_url: str, plain_url: str, tokens: int, rounds: int, model: str) -> None:
    med = statistics.median
    for url in (sealed_url, plain_url):  # warm both paths (first requests compile kernels, open sockets)
        asyncio.run(api_single(url, 8, model))
    ttft = {"sealed": [], "open": []}
    tps = {"sealed": [], "open": []}
    pairs = [("sealed", sealed_url), ("open", plain_url)]
    for n in range(rounds * 3):
        for name, url in pairs if n % 2 == 0 else pairs[::-1]:  # alternate who goes first
            ttft[name].append(asyncio.run(api_single(url, 2, model))[0])
    for n in range(rounds):
        for name, url in pairs if n % 2 == 0 else pairs[::-1]:
            tps[name].append(asyncio.run(api_single(url, tokens, model))[1])
    print(f"model {model} on one node, requests through the other, {tokens} tokens, medians")
    print(f"seal + open of a 200-byte message {seal_cost_us():6.1f} us (in-process)")
    print(f"open   decode {med(tps['open']):8.1f} tok/s   TTFT {med(ttft['open']) * 1000:7.1f} ms")
    print(f"sealed decode {med(tps['sealed']):8.1f} tok/s   TTFT {med(ttft['sealed']) * 1000:7.1f} ms")
    print(f"sealed / open decode {med(tps['sealed']) / med(tps['open']):8.3f}   (target >= 0.98)")
    delta = (med(ttft["sealed"]) - med(ttft["open"])) * 1000
    print(f"sealed - open TTFT   {delta:+8.1f} ms (target <= +2)")


if __name__ == "__main__":
    main()
