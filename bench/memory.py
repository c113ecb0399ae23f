"""What each rank holds in memory after loading, against its shard (issue 41: each rank holds its share and no
more): real node processes on loopback, the model placed on one node and as a 2-rank Pipeline, bf16 or f32 as the
checkpoint ships and int4 quantized at load. Per rank: the shard's bytes (exact, from the safetensors headers of
the tensors that rank loads, at the format it runs in), the runner's resident memory once the instance is ready
(RSS, with its anonymous and file-backed parts, and USS), its peak (VmHWM: load and warm-up), the ratio, and the
bound 1.05 x shard + RUNTIME_OVERHEAD_BYTES (engines/footprint.py). The demo model's row measures the
runtime overhead itself (its weights are a few MB).

Not yet here (issue 41's Benchmark, other parts): predicted vs measured per rank, capped nodes, tok/s, major
faults per token, KV bits rows.

Measured 2026-12-05 on the 2-core x86 VM (shared, loaded), default flags (kv_cache_gb 0.05), the 100M bench model
(float32 as it ships; int4 at load), MiB, before (safe_open's mapping kept, q/k/v and gate/up stacked by torch.cat)
-> after (pread into the kept buffers, stacked in place):
  f32  1 rank   shard 397.6  RSS 1140.5 -> 879.2 (file-backed 567.5 -> 169.6)  peak 1140.5 -> 879.2  ratio 2.87 -> 2.21
  f32  2 ranks  shard 198.8  RSS  787.4 -> 655.8 / 691.2 -> 560.9            peak 787.4 / 691.2 -> 655.8 / 669.6
  int4 1 rank   shard  56.2  RSS  553.1 -> 539.8                             peak  891.1 -> 539.8
  int4 2 ranks  shard  28.2  RSS  519.8 -> 487.5 / 391.3 -> 391.0            peak 705.9 / 547.5 -> 490.2 / 391.0
The demo model's runners (1.3 MiB of weights) hold 362-483 MiB: the runtime overhead, the same before and after;
RSS less shard is 457-484 MiB after, at every placement.
Run: .venv/bin/python bench/memory.py [--models demo,bench100m,bench700m] [--quant none,int4] [--ranks 1,2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from skulk.models.demo import BENCH_700M_MODEL_ID, BENCH_MODEL_ID, DEMO_MODEL_ID
from skulk.testing.cluster import Cluster
from skulk.testing.convergence import formed
from skulk.testing.memory import delete_instance, place_and_measure
from skulk.testing.waiting import wait_until

MODELS = {"demo": str(DEMO_MODEL_ID), "bench100m": str(BENCH_MODEL_ID), "bench700m": str(BENCH_700M_MODEL_ID)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,bench100m")
    parser.add_argument("--quant", default="none,int4")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--kv-cache-gb", type=float, default=0.05)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="skulk-memory-"))
    cluster = Cluster(root, prefix="mem", extra_env={"SKULK_SPECULATE": "0"})
    try:
        nodes = cluster.start(max(int(r) for r in args.ranks.split(",")))
        wait_until(lambda: formed(nodes), 60, "the nodes to form one cluster")
        for model in args.models.split(","):
            for quant in args.quant.split(","):
                for ranks in (int(r) for r in args.ranks.split(",")):
                    members = nodes[:ranks]
                    instance_id, rows = place_and_measure(nodes[0], members, MODELS[model],
                                                          quantization=None if quant == "none" else quant,
                                                          others=nodes[ranks:],
                                                          kv_cache_gb=args.kv_cache_gb, timeout=900)
                    print(f"{model} {quant} {ranks} rank(s)", flush=True)
                    for row in rows:
                        print("   ", row.row(), flush=True)
                    delete_instance(nodes[0], instance_id, members)
    finally:
        leftovers = cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)
        if leftovers:
            print(f"left over processes: {leftovers}")


if __name__ == "__main__":
    main()
