"""One rank of a mixed Pipeline (MLX and torch ranks in one torch.distributed group) for the parity tests, as its
own process.

argv: a JSON job {model, rank, port, layers: [[start, end] per rank], engines: ["mlx"|"torch" per rank], prompts,
tokens, chunk, out, micro_batches (default true: rank 0 pipelines micro-batches, flight.py)}. Every rank warms
up; rank 0 adds the prompts and steps until nothing is left, then shuts the group down; the sampler writes
{"tokens": {request_id: [token ids]}, "gaps": {request_id: [top-2 logprob gap]}} (a gap near 0 at a divergence
is a tie in the sampler's logits); an MLX rank writes "<forward passes> <sequences computed>" to
<out>.forwards<rank>."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skulk.engines.torch.engine import TorchEngine
from skulk.types.chat import SamplingParams


def build(job: dict[str, Any]) -> TorchEngine:
    rank, layers = job["rank"], job["layers"]
    make: type[TorchEngine] = TorchEngine
    if job["engines"][rank] == "mlx":
        from skulk.engines.mlx.mixed import MixedMlxEngine

        make = MixedMlxEngine
    engine = make(Path(job["model"]), rank=rank, world_size=len(layers), kind="pipeline",
                  start_layer=layers[rank][0], end_layer=layers[rank][1], control_group=dist.group.WORLD,
                  prefill_chunk=job.get("chunk", 8), max_seq=job.get("max_seq", 256))
    engine.share_prefixes = False
    engine.micro_batches = job.get("micro_batches", True)
    return engine


def main() -> None:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=job["rank"],
                            world_size=len(job["layers"]), timeout=timedelta(seconds=60))
    engine = build(job)
    engine.warmup()
    greedy = SamplingParams(max_tokens=job["tokens"], temperature=0, logprobs=2)
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(f"r{i}", prompt, greedy)
    got: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    while not engine.closed:
        if engine.is_scheduler and not engine.has_work():
            engine.close()
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
            top = out.logprobs.top_logprobs if out.logprobs else []
            gaps.setdefault(out.request_id, []).append(top[0].logprob - top[1].logprob if len(top) > 1 else 0.0)
    if engine.is_sampler:
        Path(job["out"]).write_text(json.dumps({"tokens": got, "gaps": gaps}))
    if hasattr(engine.model, "forwards"):  # an MLX rank: its forward passes and the sequences they computed
        Path(f"{job['out']}.forwards{job['rank']}").write_text(f"{engine.model.forwards} {engine.model.rows}")


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
