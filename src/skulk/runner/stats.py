"""Per-request timing on the runner, turned into Skulk's `generation_stats` when the request ends.

Cheap on the per-token path: one float compare and an increment per token; the clock is read once per step.
"""

from __future__ import annotations

import resource
import time

from skulk.types.chunks import GenerationStats, RequestStats
from skulk.types.memory import Memory


def peak_memory_bytes() -> int:
    """The process's peak: torch.cuda's allocator peak on a GPU, else the peak resident set (Linux: KiB)."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except ImportError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class RequestClock:
    """When a request was admitted, produced its first token and its last, and in how many steps."""

    __slots__ = ("admitted_at", "first_at", "in_flight", "last_at", "steps")

    def __init__(self, in_flight: int, now: float | None = None) -> None:
        self.admitted_at = time.perf_counter() if now is None else now
        self.first_at = 0.0
        self.last_at = 0.0
        self.in_flight = in_flight
        self.steps = 0

    def on_token(self, now: float) -> None:
        """`now` is read once per engine step, so tokens of one step count as one serving batch."""
        if now != self.last_at:
            self.steps += 1
            if not self.first_at:
                self.first_at = now
            self.last_at = now

    def stats(self, prompt_tokens: int, generated: int) -> RequestStats:
        prefill_s = max(self.first_at - self.admitted_at, 1e-9)
        decode_s = self.last_at - self.first_at
        generation = GenerationStats(
            prompt_tps=prompt_tokens / prefill_s,
            generation_tps=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            prompt_tokens=prompt_tokens,
            generation_tokens=generated,
            peak_memory_usage=Memory.from_bytes(peak_memory_bytes()),
        )
        return RequestStats(generation=generation, in_flight_at_admission=self.in_flight, serving_batches=self.steps)
