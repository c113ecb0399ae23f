"""What the multi-process parity tests share: launching one process per rank (mlx_rank.py, mixed_rank.py) and,
inside each, adding the prompts, stepping until rank 0 is done and writing what the sampler saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skulk.types.chat import SamplingParams


def launch(script: str, jobs: list[dict[str, Any]], bound_s: float) -> None:
    """One process per job (a rank), each given its job as JSON; every one must exit 0 within bound_s, and none
    outlives this call."""
    path = Path(__file__).with_name(script)
    procs = [subprocess.Popen([sys.executable, str(path), json.dumps(job)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for job in jobs]
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=bound_s)
            assert proc.returncode == 0, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def generate(engine: Any, job: dict[str, Any], done: Callable[[], bool]) -> None:
    """Rank 0 adds the job's prompts (greedy, top-2 logprobs); every rank steps until rank 0 is done (`done`),
    when it closes the group. The sampler writes {"tokens": {request_id: [ids]}, "gaps": {request_id: [top-2
    logprob gap per token]}} to job["out"] (a gap near 0 at a divergence is a tie in the sampler's logits)."""
    greedy = SamplingParams(max_tokens=job["tokens"], temperature=0, logprobs=2)
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(f"r{i}", prompt, greedy)
    got: dict[str, list[int]] = {}
    gaps: dict[str, list[float]] = {}
    while not engine.closed:
        if engine.is_scheduler and done():
            engine.close()
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
            top = out.logprobs.top_logprobs if out.logprobs else []
            gaps.setdefault(out.request_id, []).append(top[0].logprob - top[1].logprob if len(top) > 1 else 0.0)
    if engine.is_sampler:
        Path(job["out"]).write_text(json.dumps({"tokens": got, "gaps": gaps}))


def run_rank(main: Callable[[], None]) -> None:
    """Run a rank's main and leave through os._exit (MLX's ring threads can hold an ordinary exit forever),
    with the traceback printed for the test's message when it fails."""
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
