"""This node's decode speed, learned from the steps its single-rank runners serve.

A runner sends one Tokens message per engine step, holding a token for every stream that step advanced. Two
messages in a row from one single-rank runner with the same token count, close together, none of the second's
tokens a request's first (that step ran a prefill too, or followed an idle wait), time one decode step at that
batch (streams in the step: a stream's accepted speculative drafts add tokens, not streams, and are counted
apart as tokens per stream per step); divided by the model's weight gigabytes it becomes seconds per step per
GB, which predicts the same node's step on any share of any model (master/speed.py). Steps of multi-rank
runners are left out: their time holds the links as well as this node's compute.

Learned rather than calibrated at start: it is the engine as it really runs here (kernels, attention, sampling,
the runner's own per-step cost, whatever else loads the machine), and it costs nothing at start-up, where a
calibration run would import torch into every node and take CPU from whatever else starts beside it. The price
is that a node that never served has no figure: previews then borrow the measured nodes' (master/speed.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from skulk.types.ids import RunnerId
from skulk.types.links import DecodeCompute

MAX_STEP_GAP_S = 2.0
"""Two messages further apart than this are not consecutive steps (the runner idled between them)."""
SAMPLES_KEPT = 64
"""Step samples kept per batch."""
OUTLIER = 3.0
"""A step longer than this many times the median is left out (a prefill chunk rode along in it)."""


@dataclass
class _Last:
    at: float
    count: int


@dataclass
class ComputeLearner:
    """Step samples by batch; fed from the worker's chunk callback, read by the node's info gathering."""

    _last: dict[RunnerId, _Last] = field(default_factory=dict)
    _samples: dict[int, deque[float]] = field(default_factory=dict)
    _tokens: dict[int, deque[float]] = field(default_factory=dict)
    _steps: int = 0
    _calibrated: dict[int, float] = field(default_factory=dict)

    def calibrated(self, figures: dict[int, float]) -> None:
        """The start-up calibration's figures (worker/calibrate.py), reported until steps are learned."""
        self._calibrated = dict(figures)

    def on_step(self, runner: RunnerId, streams: int, model_bytes: int, now: float, *, tokens: int | None = None,
                decode_only: bool = True) -> None:
        """One Tokens message of a single-rank runner, arrived at `now`: `streams` streams advanced, by `tokens`
        tokens in all (more than `streams` when speculative drafts were accepted). `decode_only`: no token in
        it is a request's first, so no prefill (or idle wait before one) was part of the step."""
        last = self._last.get(runner)
        self._last[runner] = _Last(now, streams)
        if last is None or streams < 1 or last.count != streams or model_bytes <= 0 or not decode_only:
            return
        gap = now - last.at
        if 0 < gap <= MAX_STEP_GAP_S:
            self._samples.setdefault(streams, deque(maxlen=SAMPLES_KEPT)).append(gap / (model_bytes / 1e9))
            per_stream = (tokens if tokens is not None else streams) / streams
            self._tokens.setdefault(streams, deque(maxlen=SAMPLES_KEPT)).append(per_stream)
            self._steps += 1

    def forget(self, runner: RunnerId) -> None:
        self._last.pop(runner, None)

    def snapshot(self) -> DecodeCompute | None:
        if not self._samples:
            if not self._calibrated:
                return None
            return DecodeCompute(step_s_per_gb=dict(sorted(self._calibrated.items())),
                                 tokens_per_step=dict.fromkeys(sorted(self._calibrated), 1.0), calibrated=True)
        figures = {batch: round(typical_step(s), 6) for batch, s in sorted(self._samples.items())}
        tokens = {batch: round(statistics.fmean(t), 3) for batch, t in sorted(self._tokens.items())}
        return DecodeCompute(step_s_per_gb=figures, tokens_per_step=tokens, steps=self._steps)


def typical_step(samples: deque[float] | list[float]) -> float:
    """The mean step without the outliers. The mean, not the median: when the node's loop is late, two messages
    arrive back to back, one gap short and the next long, and only their mean is the runner's real pace."""
    cut = statistics.median(samples) * OUTLIER
    kept = [s for s in samples if s <= cut]
    return statistics.fmean(kept)
