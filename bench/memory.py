"""What each rank holds in memory after loading, against its shard (issue 41: each rank holds its share and no
more): real node processes on loopback, the model placed on one node and as a 2-rank Pipeline, bf16 or f32 as the
checkpoint ships and int4 quantized at load. Per rank: the shard's bytes (exact, from the safetensors headers of
the tensors that rank loads, at the format it runs in), the runner's resident memory once the instance is ready
(RSS, with its anonymous and file-backed parts, and USS), its peak (VmHWM: load and warm-up), the ratio, and the
bound 1.05 x shard + RUNTIME_OVERHEAD_BYTES (engines/footprint.py). The demo model's row measures the
runtime overhead itself (its weights are a few MB).

Issue 41's whole table: each placement (--ranks 1,2,3 of a Pipeline), uncapped and with every node in a cgroup-v1
memory group of --caps (skulk.testing.cgroups; a placement the cap cannot hold is printed as refused, with the
refusal): per rank the preview's predicted bytes (memory_delta_by_node: weights, runtime overhead, KV pool) beside
the measured RSS and peak, the load time (POST /place_instance to every runner ready), one greedy stream's tok/s
(completion tokens over the chat's wall time, its short prefill included) and the runners' major page faults per
generated token. --kv-tokens N adds the KV bits rows (bench/quality.py's kv_rows over its fixed text: bytes per
token, KL and top-1 against 16-bit KV, decode tok/s), --fresh the first preview of a fresh 3-node cluster
(compute calibrated at start): its predicted tok/s beside what that placement then measures.

Measured 2026-12-05 on the 2-core x86 VM (shared, loaded), default flags (kv_cache_gb 0.05), the 100M bench model
(float32 as it ships; int4 at load), MiB, before (safe_open's mapping kept, q/k/v and gate/up stacked by torch.cat)
-> after (pread into the kept buffers, stacked in place):
  f32  1 rank   shard 397.6  RSS 1140.5 -> 879.2 (file-backed 567.5 -> 169.6)  peak 1140.5 -> 879.2  ratio 2.87 -> 2.21
  f32  2 ranks  shard 198.8  RSS  787.4 -> 655.8 / 691.2 -> 560.9            peak 787.4 / 691.2 -> 655.8 / 669.6
  int4 1 rank   shard  56.2  RSS  553.1 -> 539.8                             peak  891.1 -> 539.8
  int4 2 ranks  shard  28.2  RSS  519.8 -> 487.5 / 391.3 -> 391.0            peak 705.9 / 547.5 -> 490.2 / 391.0
The demo model's runners (1.3 MiB of weights) hold 362-483 MiB: the runtime overhead, the same before and after;
RSS less shard is 457-484 MiB after, at every placement.
Reduced run 2026-12-05 (2-core VM, shared; --models bench100m --quant none --ranks 1,3 --caps none,1.0GB
--kv-tokens 256 --kv-rounds 1 --tokens 16 --fresh), MiB:
  uncapped 1 rank   load 10.8 s   4.71 tok/s  0 faults/token  rss 879.3 peak 879.3  predicted 548.2 (rss/pred 1.60)
  uncapped 3 ranks  load 19.1 s  15.15 tok/s  0 faults/token  rss 581.8 / 484.4 / 486.2  predicted 182.7 each
  1.0 GB   1 rank   refused: InsufficientMemory, 0.54 GB needed, 0.43 GB free under its 0.93 GB limit (cgroup v1)
  1.0 GB   3 ranks  load 18.5 s  16.16 tok/s  0 faults/token  rss 581.4 / 484.4 / 485.6
  KV bits (256 tokens): 16: 12288 B/token; 8: 6336 B, KL 0.00005, top-1 0.984; 4: 3456 B, KL 0.0049, top-1 0.559
  fresh cluster, first 3-rank preview 20.8 s after start: predicted 2.41 tok/s (aggregate 23.27), measured 16.64
Predicted against measured, 2026-12-06 (the same reduced run, --models bench100m --quant none,int4 --ranks 1,2
--caps none --tokens 4, fresh cluster): the preview counts each rank's exact weights, its KV pool and the runtime
overhead that node's runners measured once warm (first rank 433-436 MiB, a later rank 339-340 MiB here; the 576
MiB ceiling until one has: worker/overheads.py), MiB:
  f32  1 rank   rss 881.8  predicted 1024.8  (0.86: nothing measured yet, the ceiling)
  f32  2 ranks  rss 658.8 / 563.5  predicted 657.6 / 800.4  (1.00; 0.70: no later rank measured yet)
  int4 1 rank   rss 541.8  predicted 545.2  (0.99)
  int4 2 ranks  rss 489.5 / 393.4  predicted 489.8 / 394.5  (1.00 / 1.00)
Run: .venv/bin/python bench/memory.py [--models bench700m] [--quant none,int4] [--ranks 1,2,3] [--caps none,2.5GB]
         [--tokens 16] [--kv-tokens 2048] [--fresh]
(the 1B-shaped model of the issue is bench700m: 16 layers, hidden 2048, 2.9 GB of float32; a reduced run:
--models bench100m --quant none --ranks 1,3 --caps none,1.2GB --kv-tokens 256 --fresh)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from skulk.memory_limit import major_faults, parse_amount
from skulk.models.demo import BENCH_700M_MODEL_ID, BENCH_MODEL_ID, DEMO_MODEL_ID
from skulk.testing.cgroups import MemoryGroup, why_not
from skulk.testing.cluster import Cluster
from skulk.testing.convergence import formed
from skulk.testing.memory import RankMemory, delete_instance, place_and_measure
from skulk.testing.nodes import LocalNode
from skulk.testing.waiting import wait_until

MODELS = {"demo": str(DEMO_MODEL_ID), "bench100m": str(BENCH_MODEL_ID), "bench700m": str(BENCH_700M_MODEL_ID)}
MIB = 1024**2
PROMPT = "Tell me a story about a fox."


def predicted(api: LocalNode, model_id: str, members: list[LocalNode], others: list[LocalNode],
              quant: str | None, kv_cache_gb: float) -> dict[str, int]:
    """The preview's bytes per node (memory_delta_by_node) for the Pipeline over exactly `members` ({} if none)."""
    params: dict[str, Any] = {"model_id": model_id, "sharding": "Pipeline", "engine": "torch",
                              "kv_cache_gb": kv_cache_gb, "excluded_node_ids": [n.node_id for n in others]}
    if quant:
        params["quantization"] = quant
    with api.client() as client:
        previews = client.get("/instance/previews", params=params).json().get("previews", [])
    wanted = {n.node_id for n in members}
    for preview in previews:
        delta = preview.get("memory_delta_by_node") or {}
        if preview.get("error") is None and set(delta) == wanted:
            return {n: int(b) for n, b in delta.items()}
    return {}


def chat(api: LocalNode, model_id: str, tokens: int, runners: list[int]) -> tuple[int, float, int]:
    """One greedy chat after a 2-token warm-up: (completion tokens, tok/s over its wall time, the runners' major
    faults meanwhile)."""
    api.post("/v1/chat/completions", {"model": model_id, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}, timeout=600)
    before = major_faults(runners)
    started = time.perf_counter()
    status, reply = api.post("/v1/chat/completions", {"model": model_id, "max_tokens": tokens, "temperature": 0,
                                                      "messages": [{"role": "user", "content": PROMPT}]}, timeout=600)
    elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"chat failed ({status}): {reply}")
    done = int(reply["usage"]["completion_tokens"])
    return done, done / elapsed, major_faults(runners) - before


def rank_row(rank: RankMemory, guess: int | None) -> str:
    said = f"predicted {guess / MIB:7.1f}  rss/pred {rank.rss / guess:4.2f}" if guess else "predicted       -"
    return f"{rank.row()}  {said}"


def placement_rows(nodes: list[LocalNode], model: str, quant: str, ranks: int, cap: str, args: Any) -> None:
    """One placement's block: the header with load time, tok/s and faults per token; a row per rank."""
    api, members, others = nodes[0], nodes[:ranks], nodes[ranks:]
    model_id, quantize = MODELS[model], None if quant == "none" else quant
    label = f"{model} {quant} {ranks} rank(s) cap {cap}"
    guesses = predicted(api, model_id, members, others, quantize, args.kv_cache_gb)
    started = time.perf_counter()
    try:
        instance_id, rows = place_and_measure(api, members, model_id, quantization=quantize, others=others,
                                              kv_cache_gb=args.kv_cache_gb, timeout=900)
    except RuntimeError as exc:
        print(f"{label}: refused: {str(exc)[:400]}", flush=True)
        return
    load_s = time.perf_counter() - started
    runners = sorted(pid for n in members for pid in n.runner_pids())
    tokens, tps, faults = chat(api, model_id, args.tokens, runners)
    print(f"{label}: load {load_s:6.1f} s  {tps:6.2f} tok/s ({tokens} tokens)  "
          f"major faults {faults} ({faults / max(tokens, 1):.2f} a token)", flush=True)
    for row in rows:
        print("   ", rank_row(row, guesses.get(row.node_id)), flush=True)
    delete_instance(api, instance_id, members)


def capped(nodes: list[LocalNode], cap: str, stack: ExitStack) -> None:
    """Move every node into its own memory group of `cap` bytes (runners started later are born inside) and wait
    until each advertises the group's limit."""
    if (why := why_not()) is not None:
        raise SystemExit(f"--caps {cap}: {why}")
    size = parse_amount(cap).bytes
    if size is None:
        raise SystemExit(f"--caps takes sizes, not fractions: {cap}")
    groups = [stack.enter_context(MemoryGroup(size)) for _ in nodes]
    for node, group in zip(nodes, groups, strict=True):
        assert node.process is not None
        group.add(node.process.pid)

    def sources() -> set[object]:
        memory = (nodes[0].get("/state") or {}).get("nodeMemory", {})
        return {(m.get("limitSource"), m["ramTotal"]["inBytes"]) for m in memory.values()}

    wait_until(lambda: sources() == {("cgroup v1", groups[0].limit)}, 60, "every node's group limit in /state")


def placements(nodes: list[LocalNode], args: Any) -> None:
    with ExitStack() as stack:
        for cap in args.caps.split(","):
            if cap != "none":
                stack.close()
                capped(nodes, cap, stack)
            for model in args.models.split(","):
                for quant in args.quant.split(","):
                    for ranks in (int(r) for r in args.ranks.split(",")):
                        placement_rows(nodes, model, quant, ranks, cap, args)


def kv_bits(model_dir: Path, tokens: int, rounds: int) -> None:
    """bench/quality.py's KV rows over its fixed text, for this model (bf16 weights, as quality.py runs them)."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import quality
    from skulk.engines.torch.loader import load_model
    from skulk.engines.torch.tokenizer import ChatTokenizer

    ids = ChatTokenizer(model_dir).encode(quality.fixed_text())[:tokens]
    quality.KV_CONTEXT = min(quality.KV_CONTEXT, len(ids))
    quality.KV_ROUNDS = rounds
    model = load_model(model_dir, dtype=torch.bfloat16)
    print(f"\nKV bits, {model_dir.name}: {len(ids)} tokens of bench/quality.py's text", flush=True)
    quality.kv_rows(model, list(quality.chunk_logprobs(model, ids)), ids)


def first_preview(root: Path, model_id: str, tokens: int, kv_cache_gb: float) -> None:
    """A fresh 3-node cluster that calibrates its compute at start: the first preview over all three nodes that
    predicts, its predicted tok/s (and how long after start it came), then that placement served and measured."""
    cluster = Cluster(root / "fresh", prefix="fresh", extra_env={"SKULK_SPECULATE": "0",
                                                                 "SKULK_CALIBRATE_COMPUTE": "1"})
    started = time.perf_counter()
    try:
        nodes = cluster.start(3)
        wait_until(lambda: formed(nodes), 60, "the fresh nodes to form one cluster")

        def first() -> dict[str, Any] | None:
            with nodes[0].client() as client:
                found = client.get("/instance/previews", params={"model_id": model_id, "sharding": "Pipeline",
                                                                 "engine": "torch", "kv_cache_gb": kv_cache_gb})
            ok = [p for p in found.json().get("previews", []) if p.get("error") is None
                  and len(p.get("memory_delta_by_node") or {}) == len(nodes)]
            return next((p for p in ok if p.get("predicted_decode_tps") is not None), None)

        wait_until(lambda: first() is not None, 120, "a preview over the three nodes that predicts")
        preview = first()
        assert preview is not None
        waited = time.perf_counter() - started
        members = [n for n in nodes if n.node_id in (preview.get("memory_delta_by_node") or {})]
        others = [n for n in nodes if n not in members]
        instance_id, _ = place_and_measure(nodes[0], members, model_id, others=others, kv_cache_gb=kv_cache_gb,
                                           timeout=900)
        runners = sorted(pid for n in members for pid in n.runner_pids())
        done, tps, _ = chat(nodes[0], model_id, tokens, runners)
        print(f"\nfirst preview of a fresh cluster ({waited:.1f} s after start), {len(members)} rank(s): predicted "
              f"{preview['predicted_decode_tps']} tok/s (aggregate {preview.get('predicted_aggregate_tps')}), "
              f"measured {tps:.2f} tok/s ({done} tokens)", flush=True)
        delete_instance(nodes[0], instance_id, members)
    finally:
        if leftovers := cluster.stop_all():
            print(f"left over processes: {leftovers}")


def arguments() -> Any:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default="bench700m")
    parser.add_argument("--quant", default="none,int4")
    parser.add_argument("--ranks", default="1,2,3")
    parser.add_argument("--caps", default="none,2.5GB", help="'none' (uncapped) and/or sizes of a cgroup-v1 limit")
    parser.add_argument("--kv-cache-gb", type=float, default=0.05)
    parser.add_argument("--tokens", type=int, default=16, help="generated per chat (tok/s, faults per token)")
    parser.add_argument("--kv-tokens", type=int, default=0, help="KV bits rows over this many tokens (0: none)")
    parser.add_argument("--kv-rounds", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="the first preview of a fresh cluster")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    root = Path(tempfile.mkdtemp(prefix="skulk-memory-"))
    cluster = Cluster(root, prefix="mem", extra_env={"SKULK_SPECULATE": "0"})
    try:
        nodes = cluster.start(max(int(r) for r in args.ranks.split(",")))
        wait_until(lambda: formed(nodes), 60, "the nodes to form one cluster")
        placements(nodes, args)
        for model in args.models.split(",") if args.kv_tokens else ():
            kv_bits(nodes[0].home / "models" / MODELS[model].replace("/", "--"), args.kv_tokens, args.kv_rounds)
    finally:
        leftovers = cluster.stop_all()
        if leftovers:
            print(f"left over processes: {leftovers}")
    try:
        if args.fresh:
            first_preview(root, MODELS[args.models.split(",")[0]], args.tokens, args.kv_cache_gb)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
