"""Spans of traced tasks on one rank: per-request phases and engine steps, decode batched per DECODE_BATCH.

Runtime tracing (runbook 004) is keyed by the master's task id. A rank learns that a task is traced from its
RunTask (task.traced); a rank that is not the scheduler may see the task's admission in a step header first,
so the prefill timing of untraced-yet tasks is kept until the task ends and emitted if the flag arrives.
With no task traced, each engine step costs one empty-set test here.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from skulk.types.tracing import TraceSpan

DECODE_BATCH = 16
"""Decode steps folded into one span: a span per token would cost more than the step it measures."""
CATEGORY = "runner"
_NONE: frozenset[str] = frozenset()


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)


class SpanBook:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.traced: set[str] = set()
        self._decode: dict[str, list[float]] = {}  # task -> [first start, last end, steps, waited]
        self._prefills: dict[str, tuple[float, float, float]] = {}  # admitted, not (yet) known as traced
        self._ready: list[TraceSpan] = []

    def trace(self, task_id: str) -> None:
        self.traced.add(task_id)
        early = self._prefills.pop(task_id, None)
        if early is not None:
            self._add(task_id, "prefill", early[0], early[1], pipelineWaitUs=_us(early[2]))

    def span(self, task_id: str, name: str, start: float, end: float, **args: int | float | str) -> None:
        if task_id in self.traced:
            self._add(task_id, name, start, end, **args)

    def step(
        self, start: float, end: float, prefilled: Collection[str], active: Iterable[str], wait_s: float = 0.0
    ) -> None:
        """One engine step: a prefill span for the tasks admitted in it, a decode step for the others. wait_s:
        how long the step waited on peers (pipeline recv, token share), kept as pipelineWaitUs."""
        new = set(prefilled) if prefilled else _NONE
        for task_id in new:
            if task_id in self.traced:
                self._add(task_id, "prefill", start, end, batch=len(new), pipelineWaitUs=_us(wait_s))
            else:
                self._prefills[task_id] = (start, end, wait_s)
        if not self.traced:
            return
        for task_id in active:
            if task_id in self.traced and task_id not in new:
                batch = self._decode.setdefault(task_id, [start, end, 0, 0.0])
                batch[1] = end
                batch[2] += 1
                batch[3] += wait_s
                if batch[2] >= DECODE_BATCH:
                    self._flush_decode(task_id)

    def end(self, task_id: str) -> None:
        self._prefills.pop(task_id, None)
        if task_id in self.traced:
            self._flush_decode(task_id)
            self.traced.discard(task_id)

    def _flush_decode(self, task_id: str) -> None:
        batch = self._decode.pop(task_id, None)
        if batch is not None:
            self._add(task_id, "decode", batch[0], batch[1], steps=int(batch[2]), pipelineWaitUs=_us(batch[3]))

    def _add(self, task_id: str, name: str, start: float, end: float, **args: int | float | str) -> None:
        self._ready.append(
            TraceSpan(task_id=task_id, name=name, category=CATEGORY, rank=self.rank, start_us=_us(start),
                      duration_us=max(0, _us(end) - _us(start)), args=args)
        )

    def drain(self) -> list[TraceSpan]:
        spans, self._ready = self._ready, []
        return spans

    @property
    def has_spans(self) -> bool:
        return bool(self._ready)
