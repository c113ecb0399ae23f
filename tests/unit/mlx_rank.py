"""One rank of an MLX ring for the parity tests, as its own process (MLX forms one group per process).

argv: a JSON job {model, rank, hosts, layers, tensor, chunk, prompts, tokens, out}; rank_jobs.generate runs it
and the sampler writes its tokens and, per token, the top two logprobs' gap (to tell a bf16 tie from a real
divergence). With "runs" (a list of {model, layers, tensor, out} overriding the job's), the ring runs each in turn,
a fresh engine per run over the one group: many models and layouts for one ring's start-up."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rank_jobs import generate, run_rank  # beside this script (its folder is sys.path[0])

from skulk.engines.mlx.engine import MlxEngine
from skulk.engines.mlx.ring import RingLink, connect


def main() -> None:
    job = json.loads(sys.argv[1])
    link = RingLink(connect(job["rank"], job["hosts"]))
    for run in job.get("runs", [{}]):
        serve(link, {**job, **run})


def serve(link: RingLink, job: dict[str, Any]) -> None:
    tensor = job.get("tensor", False)
    engine = MlxEngine(Path(job["model"]), link=link, layers=None if tensor else tuple(job["layers"]),
                       tensor=tensor, prefill_chunk=job.get("chunk", 8), max_seq=256)
    engine.warmup()
    generate(engine, job, lambda: not (engine._adds or engine._pending or engine._prefilling or engine._running
                                       or engine._releases))


if __name__ == "__main__":
    run_rank(main)
