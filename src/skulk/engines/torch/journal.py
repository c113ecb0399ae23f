"""What the engine tells the runner beyond tokens, kept by one part every other part writes to: request events
(wire.Admitted, Started, Released, taken by the runner each loop), the runner phase the current step is in (the
on_phase hook), and the speculative draft tokens proposed and accepted (kv_usage reports them, so GET /metrics
reads them from the runner's flight recorder).

Apart from the scheduler and the step so that neither holds the other to report: admission (admission.py) records
events and speculative counts, the step (step.py) enters phases.
"""

from __future__ import annotations

from collections.abc import Callable

from skulk.types.runners import RunnerPhase

from .wire import RequestEvent, StepKind

PhaseHook = Callable[[RunnerPhase, str], None]
PHASES: dict[tuple[str, StepKind], RunnerPhase] = {
    ("pipeline", StepKind.PREFILL): "prefill_pipeline",
    ("pipeline", StepKind.DECODE): "decode_stream",
    ("tensor", StepKind.PREFILL): "prefill_barrier",
    ("tensor", StepKind.DECODE): "decode_barrier",
}
"""The runner phase of a step of a kind, by how the group splits the model (a single rank counts as Pipeline)."""


class Journal:
    """One rank's request events, phase and speculative counts (module docstring)."""

    def __init__(self) -> None:
        self.events: list[RequestEvent] = []
        self.on_phase: PhaseHook | None = None
        self.phase: RunnerPhase = "idle"
        # added once per request at its release (never per token)
        self.spec_drafted = 0
        self.spec_accepted = 0

    def enter(self, phase: RunnerPhase, event: str) -> None:
        """Tell the runner when the phase changes (a repeated phase costs nothing)."""
        if phase != self.phase:
            self.phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    def take(self) -> list[RequestEvent]:
        """The events since the last call (cheap when nothing happened)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
