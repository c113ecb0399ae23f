"""One rank of a mixed Pipeline (MLX and torch ranks in one torch.distributed group) for the parity tests, as its
own process.

argv: a JSON job {model, rank, port, layers: [[start, end] per rank], engines: ["mlx"|"torch" per rank], prompts,
tokens, chunk, max_seq, out, micro_batches (default true: rank 0 pipelines micro-batches, flight.py), block_size,
dtype, share_prefixes (default false), kind (default "pipeline"; "tensor": every rank all layers, its share of the
heads)}. Every rank warms up; rank_jobs.generate runs the job and the sampler writes its tokens and gaps; an MLX rank
writes "<forward passes> <sequences computed>" to <out>.forwards<rank>. With "runs" (a list of {model, out}
overriding the job's), the group runs each in turn, fresh engines over the one group."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_jobs import generate, run_rank  # beside this script (its folder is sys.path[0])

from skulk.engines.torch.engine import TorchEngine


def build(job: dict[str, Any]) -> TorchEngine:
    rank, layers = job["rank"], job["layers"]
    make: type[TorchEngine] = TorchEngine
    if job["engines"][rank] == "mlx":
        from skulk.engines.mlx.mixed import MixedMlxEngine

        make = MixedMlxEngine
    extra = {key: job[key] for key in ("block_size", "dtype") if key in job}
    engine = make(Path(job["model"]), rank=rank, world_size=len(layers), kind=job.get("kind", "pipeline"),
                  start_layer=layers[rank][0], end_layer=layers[rank][1], control_group=dist.group.WORLD,
                  prefill_chunk=job.get("chunk", 8), max_seq=job.get("max_seq", 256), **extra)
    engine.share_prefixes = job.get("share_prefixes", False)
    engine.micro_batches = job.get("micro_batches", True)
    return engine


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=job["rank"],
                            world_size=len(job["layers"]), timeout=timedelta(seconds=60))
    for run in job.get("runs", [{}]):
        serve({**job, **run})


def serve(job: dict[str, Any]) -> None:
    engine = build(job)
    engine.warmup()
    generate(engine, job, lambda: not engine.has_work())
    if hasattr(engine.model, "forwards"):  # an MLX rank: its forward passes and the sequences they computed
        Path(f"{job['out']}.forwards{job['rank']}").write_text(f"{engine.model.forwards} {engine.model.rows}")


if __name__ == "__main__":
    run_rank(main)
