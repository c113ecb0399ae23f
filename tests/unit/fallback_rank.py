"""One rank of a transformers-fallback Pipeline (engines/torch/fallback.py) for the parity tests, as its own process.

argv: a JSON job {rank, port, world_size, prompts, tokens, runs: [{model, layers: [[start, end] per rank], out}]}:
one group runs each model in turn, a fresh engine each; every rank warms up, rank_jobs.generate runs the prompts
and the sampler writes its tokens and gaps to the run's out."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rank_jobs import generate, run_rank  # beside this script (its folder is sys.path[0])

from skulk.engines.torch.fallback import FallbackEngine


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    rank, world = job["rank"], job["world_size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    for run in job["runs"]:
        start, end = run["layers"][rank]
        engine = FallbackEngine(Path(run["model"]), max_seq=256, rank=rank, world_size=world, start_layer=start,
                                end_layer=end, control_group=dist.group.WORLD)
        engine.warmup()
        generate(engine, {**job, **run}, lambda e=engine: not e.has_work())


if __name__ == "__main__":
    run_rank(main)
