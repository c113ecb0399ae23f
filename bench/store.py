"""The LAN model store: staging throughput and what an unstaged model adds to time-to-ready.

Starts real nodes on loopback: a store host serving a generated ~400 MB model from its store_path, and a
worker. Prints, from one run:
  staging throughput: the worker's staging code (skulk.store.client.stage) pulling every file from the store
      host's file server ÷ a plain local copy (shutil.copyfile) of the same bytes, best of --rounds each,
      interleaved                                                                     (target >= 0.8)
      and the same with each staged file checked against the store's SHA-256, as a worker stages (issue 27)
  time from POST /place_instance to a ready 2-node Pipeline instance: model not yet staged on the worker
      (purged first) vs already staged (deleted and placed again; the grace budget kept the copy), medians

Run: .venv/bin/python bench/store.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from skulk.models.demo import generate_random_llama
from skulk.store import client
from skulk.testing.cluster import instance_ready
from skulk.testing.nodes import LocalNode, free_port
from skulk.testing.waiting import wait_until

MODEL = "bench/store-400m"
SHAPE = {"hidden_size": 1024, "n_layers": 7, "n_heads": 16, "n_kv_heads": 4, "intermediate_size": 4096}


def _config(store_path: Path, port: int) -> str:
    return (
        "model_store:\n  enabled: true\n  store_host: store\n  store_address: 127.0.0.1\n"
        f"  store_port: {port}\n  store_path: {store_path}\n  download: {{allow_hf_fallback: false}}\n"
    )


def _node(root: Path, name: str, cluster: str, config: str, peers: list[str]) -> LocalNode:
    home = root / name
    home.mkdir(parents=True)
    (home / "skulk.yaml").write_text(config)
    return LocalNode(home=home, cluster=cluster, peers=peers, extra_env={"SKULK_NODE_NAME": name}).start()


def throughput(base: str, source: Path, scratch: Path, rounds: int) -> tuple[float, float, float, int]:
    """(store MB/s, store MB/s with each file checked against the store's SHA-256, local copy MB/s, bytes): best
    of rounds, the three interleaved so noise hits all."""
    files, sha256 = client.store_listing(base, MODEL)  # the store hashes the model here, once
    total = sum(files.values())
    best_stage = best_copy = best_verified = 0.0
    for i in range(rounds):
        target = scratch / f"copy{i}"
        target.mkdir()
        start = time.perf_counter()
        for name in files:
            shutil.copyfile(source / name, target / name)
        best_copy = max(best_copy, total / (time.perf_counter() - start))
        shutil.rmtree(target)
        staged = scratch / f"staged{i}"
        start = time.perf_counter()
        client.stage(base, MODEL, files, staged, None)
        best_stage = max(best_stage, total / (time.perf_counter() - start))
        shutil.rmtree(staged)
        start = time.perf_counter()
        client.stage(base, MODEL, files, staged, None, sha256)
        best_verified = max(best_verified, total / (time.perf_counter() - start))
        shutil.rmtree(staged)
    return best_stage / 1e6, best_verified / 1e6, best_copy / 1e6, total


def time_to_ready(host: LocalNode) -> float:
    start = time.perf_counter()
    status, reply = host.post("/place_instance", {"model_id": MODEL, "min_nodes": 2}, timeout=120)
    assert status == 200, reply
    instance_id = reply["instanceId"]
    wait_until(lambda: instance_ready(host, instance_id), 300, "the instance to be ready", poll=0.05)
    elapsed = time.perf_counter() - start
    assert host.client().delete(f"/instance/{instance_id}").status_code == 200
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="skulk-bench-store-"))
    store_path = root / "store-copies"
    model_dir = generate_random_llama(store_path / MODEL.replace("/", "--"), seed=3, **SHAPE)
    port = free_port()
    nodes: list[LocalNode] = []
    try:
        cluster = f"bs{uuid.uuid4().hex[:8]}"
        nodes.append(_node(root, "store", cluster, _config(store_path, port), []))
        nodes.append(_node(root, "worker", cluster, _config(store_path, port), [nodes[0].endpoint]))
        host, worker = (n.wait_ready() for n in nodes)
        wait_until(lambda: len((host.get("/state") or {}).get("nodeIdentities", {})) == 2, 60, "two nodes")
        status, reply = host.post("/models/add", {"model_id": MODEL})
        assert status == 200, reply
        stage_mb_s, verified_mb_s, copy_mb_s, total = throughput(client.store_url("127.0.0.1", port), model_dir,
                                                                 root, args.rounds)
        print(f"model: {MODEL}, {total / 1e6:.0f} MB")
        print(f"staging from the store host over loopback: {stage_mb_s:8.1f} MB/s")
        print(f"plain local file copy of the same bytes:   {copy_mb_s:8.1f} MB/s")
        print(f"ratio staging / local copy: {stage_mb_s / copy_mb_s:.2f}   (target >= 0.8)")
        print(f"staging with SHA-256 checks (what a worker does): {verified_mb_s:8.1f} MB/s, "
              f"{verified_mb_s / stage_mb_s:.2f} of unchecked, {verified_mb_s / copy_mb_s:.2f} of a local copy")
        staged = worker.home / "staging" / MODEL.replace("/", "--")
        cold: list[float] = []
        warm: list[float] = []
        for _ in range(args.rounds):
            status, reply = host.post("/store/purge-staging", {"modelId": MODEL})
            assert status == 200 and not staged.exists(), reply
            cold.append(time_to_ready(host))
            wait_until(lambda: staged.is_dir(), 10, "the staged copy to be kept")
            warm.append(time_to_ready(host))
        cold_s, warm_s = statistics.median(cold), statistics.median(warm)
        print(f"place -> ready, not yet staged on the worker: {cold_s:6.2f} s (median of {args.rounds})")
        print(f"place -> ready, already staged:               {warm_s:6.2f} s (median of {args.rounds})")
        print(f"staging adds {cold_s - warm_s:.2f} s ({cold_s / warm_s:.2f}x)")
    finally:
        for node in nodes:
            node.stop()
        for node in nodes:
            node.reap_leftovers()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
