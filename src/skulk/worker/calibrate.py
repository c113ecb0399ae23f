"""This node's decode compute measured at start, so the first preview of a fresh cluster can predict.

Learned figures (worker/compute.py) need served steps; until then a node has none, and a cluster that never
served predicted nothing. So at start a child process (`python -m skulk.worker.calibrate`, niced: torch stays
out of the node's own memory, and the node's loops keep their CPU) times what a decode step is made of on this
machine: the weight matrices of a transformer's layers, read once per step, as bfloat16 matrix-vector products
at a batch of 1 and of 8 streams, with the engine's own decode kernel (engines/torch/cpu_kernels.py; torch's
where that does not build). It takes a few seconds. The figures are seconds per step per GB of weights, as
the learned ones are, marked `calibrated`; the kernels alone are faster than the whole engine (attention,
sampling and the runner's own work add to a step), so served steps replace them as soon as there are any.

The same child first measures a torch runner's runtime overhead (`runtime_overhead`: the engine built and warmed
over the built-in demo model, whose weights are 1.3 MB, then its RSS less weights and KV), so the first preview
counts this machine's runtime rather than the default ceiling: 430.8 MiB here, against 433-436 MiB measured by
real first-rank runners beside their shards. A runner's own measurement replaces it (worker/overheads.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("skulk.worker.calibrate")

HIDDEN, WIDE, MATRICES = 2048, 8192, 4
"""Four 2048 x 8192 bfloat16 matrices: 128 MiB, a 1B-class model's layer and a half, past any CPU cache."""
BATCHES = (1, 8)
ROUNDS = 5
TIMEOUT_S = 60.0


def measure() -> dict[int, float]:
    """Seconds per step per GB at each batch: the median of ROUNDS passes over every matrix (after one warm-up)."""
    import torch

    from skulk.engines.torch import cpu_kernels

    weights = [torch.randn(WIDE, HIDDEN, dtype=torch.bfloat16) for _ in range(MATRICES)]
    gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    if cpu_kernels.available():  # the engine's own decode kernel, where it runs
        kernels = [cpu_kernels.HalfMatrix(w, None) for w in weights]
        steps: list[Any] = [lambda x, m=m: m(x) for m in kernels]
    else:
        steps = [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]
    figures: dict[int, float] = {}
    with torch.inference_mode():
        for batch in BATCHES:
            x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16)
            for step in steps:
                step(x)
            passes = []
            for _ in range(ROUNDS):
                started = time.perf_counter()
                for step in steps:
                    step(x)
                passes.append(time.perf_counter() - started)
            figures[batch] = round(statistics.median(passes) / gb, 6)
    return figures


def runtime_overhead() -> int:
    """What a first-rank torch runner holds besides its weights and KV pool, measured on the demo model in this
    process (before the timing's matrices are allocated)."""
    import tempfile
    from pathlib import Path

    import psutil

    from skulk.engines.torch.engine import TorchEngine
    from skulk.models.demo import ensure_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        engine = TorchEngine(ensure_demo_model(Path(tmp)), kv_cache_bytes=16 << 20)
        engine.warmup()
        weights, kv = engine.footprint()
        return max(0, psutil.Process().memory_info().rss - weights - kv)


@dataclass(frozen=True)
class Calibration:
    steps: dict[int, float]
    """Seconds per step per GB of weights, by batch."""
    overhead: int
    """A first-rank torch runner's runtime overhead, bytes."""


async def calibrate() -> Calibration | None:
    """Run the measurement in a niced child; None (and one log line) when it fails or takes too long."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skulk.worker.calibrate", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))
    try:
        out, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        found = json.loads(out.decode())
        figures = {int(k): float(v) for k, v in found["steps"].items()}
        overhead = int(found["overhead"])
    except (TimeoutError, ValueError, AttributeError, KeyError, TypeError) as exc:
        process.kill() if process.returncode is None else None
        log.warning("compute calibration failed (%s); previews predict once this node has served", exc)
        return None
    log.info("compute calibrated: %s s per step per GB by batch; a runner's runtime %.0f MiB", figures,
             overhead / 2**20)
    if not figures or any(v <= 0 for v in figures.values()) or overhead <= 0:
        return None
    return Calibration(figures, overhead)


if __name__ == "__main__":
    first = runtime_overhead()  # before measure()'s matrices, which would count as runtime
    print(json.dumps({"overhead": first, "steps": measure()}))
