"""Rank 0's measured step times that size a prefill chunk (schedule.chunk_tokens): the running average of a decode
step, and what the last chunk that rode on one (a MIXED step) added to it.

A part of its own because the step measures what admission reads: the engine times each step and records it here
(StepTimes.measure), and admission's plan for the next step sizes its chunk from it (StepTimes.chunk).
"""

from __future__ import annotations

from .header import StepKind
from .schedule import chunk_tokens

EMA = 0.3
"""Weight of the newest step in the running averages."""


class StepTimes:
    """Rank 0's decode step average and last riding chunk's cost (module docstring)."""

    def __init__(self, prefill_chunk: int) -> None:
        self.prefill_chunk = prefill_chunk
        self.decode_s = 0.0
        self.last_chunk: tuple[int, float] | None = None
        """(tokens, seconds) the last chunk that rode on a decode step added to it."""

    def measure(self, kind: StepKind, seconds: float, tokens: int) -> None:
        """A step's time. A prefill step alone forgets the last chunk: its chunk ran alone, on another path and
        often at another size (a burst's prompts together), so it says little about what a riding chunk adds."""
        if kind == StepKind.DECODE:
            self.decode_s += EMA * (seconds - self.decode_s) if self.decode_s else seconds
        elif kind == StepKind.MIXED:
            self.last_chunk = (tokens, max(seconds - self.decode_s, 0.0))
        elif kind == StepKind.PREFILL:
            self.last_chunk = None

    def chunk(self, decoding: bool) -> int:
        """The next step's prefill chunk in tokens (schedule.chunk_tokens)."""
        return chunk_tokens(self.prefill_chunk, decoding=decoding, decode_s=self.decode_s,
                            last_chunk=self.last_chunk)
