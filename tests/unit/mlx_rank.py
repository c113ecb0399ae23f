"""One rank of an MLX ring for the parity tests, as its own process (MLX forms one group per process).

argv: a JSON job {model, rank, hosts, layers, prompts, tokens, out}; rank 0 adds the prompts, every rank steps
until rank 0 has nothing left, then rank 0 shuts the ring down; the sampler writes {request_id: [token ids]}
and, per token, the top two logits' gap (to tell a bf16 tie from a real divergence)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from skulk.engines.mlx.engine import MlxEngine
from skulk.engines.mlx.ring import RingLink, connect
from skulk.types.chat import SamplingParams


def main() -> None:
    job = json.loads(sys.argv[1])
    link = RingLink(connect(job["rank"], job["hosts"]))
    tensor = job.get("tensor", False)
    engine = MlxEngine(Path(job["model"]), link=link, layers=None if tensor else tuple(job["layers"]),
                       tensor=tensor, prefill_chunk=job.get("chunk", 8), max_seq=256)
    engine.warmup()
    greedy = SamplingParams(max_tokens=job["tokens"], temperature=0, logprobs=2)
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(f"r{i}", prompt, greedy)
    got: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    while not engine.closed:
        if engine.is_scheduler and not (engine._adds or engine._pending or engine._prefilling or engine._running
                                        or engine._releases):
            engine.close()
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
            top = out.logprobs.top_logprobs if out.logprobs else []
            gaps.setdefault(out.request_id, []).append(top[0].logprob - top[1].logprob if len(top) > 1 else 0.0)
    if engine.is_sampler:
        Path(job["out"]).write_text(json.dumps({"tokens": got, "gaps": gaps}))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # MLX's ring threads can hold an ordinary exit forever
    sys.stdout.flush()
    os._exit(0)
