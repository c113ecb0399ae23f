"""A request's wait is bounded by its share (issue 43): the torch engine admits first come, first served into a
bounded batch, and a preempted request goes back to the head of the queue, so a short request that arrives behind
long ones waits for those ahead of it only, never for the long ones that keep arriving after it.

Counted in engine steps, never in time, on the demo model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.timing import StepTimes
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # runs real model compute: `make test`, not `make test-fast`

LONG = SamplingParams(max_tokens=24, temperature=0)
SHORT = SamplingParams(max_tokens=3, temperature=0)
BATCH = 2
TEXT = [*b"Fair schedulers bound how long a request waits behind others. "] * 4


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def prompt(n: int, salt: int) -> list[int]:
    return [258, *((w + salt) % 250 + 1 for w in TEXT)][:n]


def never_ending(where: str, req: Any) -> int | None:
    """Long requests never sample EOS: each runs to its max_tokens (the demo model's own tokens might stop early)."""
    return 65 if where == "sample" and req.request_id.startswith("long") else None


@pytest.fixture(autouse=True)
def fixed_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk sizes stay at the floor instead of following measured step times: the step counts are the same
    however loaded the machine is."""
    monkeypatch.setattr(StepTimes, "measure", lambda *_: None)


@pytest.mark.parametrize(("long_prompt", "kv_cache_bytes", "preempts"), [(40, None, False), (120, 0, True)],
                         ids=["roomy-pool", "least-pool-preempting"])
def test_a_short_request_behind_long_ones_finishes_within_its_share(
        demo_dir: Path, monkeypatch: pytest.MonkeyPatch, long_prompt: int, kv_cache_bytes: int | None,
        preempts: bool) -> None:
    """Four long requests fill the batch and its queue, a short one arrives, and a new long one arrives every
    step after it. The short one finishes once the requests ahead of it are served (two rounds of the batch),
    whatever keeps arriving; in the least pool (one whole context) two long prompts outgrow it and the engine
    preempts as well (a preempted request goes back to the head of the queue)."""
    engine = TorchEngine(demo_dir, max_seq=256, max_batch=BATCH, block_size=16, kv_cache_bytes=kv_cache_bytes)
    engine.fault_hook = never_ending
    preempted: list[str] = []
    preempt = engine.scheduler.preempt
    monkeypatch.setattr(engine.scheduler, "preempt", lambda p: (preempted.append(p.request_id), preempt(p))[1])
    ahead = 4
    for i in range(ahead):
        engine.add_request(f"long{i}", prompt(long_prompt, salt=i), LONG)
    engine.step()
    engine.add_request("short", prompt(12, salt=9), SHORT)
    share = math.ceil(ahead / BATCH) * LONG.max_tokens + 2 * SHORT.max_tokens  # rounds ahead, then its own
    bound = share + 8  # prefill steps and preemption's recomputation
    done, steps, arrivals = False, 0, ahead
    while not done and steps <= 4 * bound:  # a starving request is caught, not waited on forever
        engine.add_request(f"long{arrivals}", prompt(long_prompt, salt=arrivals), LONG)  # the line never ends
        arrivals += 1
        steps += 1
        done = any(o.request_id == "short" and o.finish_reason is not None for o in engine.step())
    assert done and steps <= bound, f"the short request took {steps} steps, its share is {share}"
    assert bool(preempted) == preempts
