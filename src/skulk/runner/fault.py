"""Debug settings of the runner: fault injection (SKULK_FAULT) and the flight-recorder switch (SKULK_FLIGHT_RECORDER).

A hang in a distributed request is hard to reproduce on demand, yet the diagnostics that explain it (timeline,
rank-disagreement warning, `skulk diag`) need one to be tested. `SKULK_FAULT` makes one rank stall on purpose:

    SKULK_FAULT=stall:<phase>[:rank=<n>][:after=<seconds>]

- `<phase>`: one of the runner phases (`prefill_pipeline`, `decode_stream`, `decode_barrier`, ...).
- `rank=<n>`: only the runner of that device rank stalls; any rank when omitted.
- `after=<seconds>`: only an entry into the phase at least this long after the fault was armed trips it.

The fault trips once, the first time the runner enters the phase: the entry for that phase is flushed to the
supervisor first (so diagnostics show the rank stuck there), then the runner's main thread sleeps on an event
that is never set: no CPU is spun and the process stays alive, as a wedged rank would. Phases a runner passes
only while starting arm at once; all others arm when the runner is ready, so the warmup's own pass through the
pipeline phases does not trip a fault meant for a real request. An invalid value is logged once and ignored:
a typo in a debug setting must never take a node down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast, get_args

from skulk.types.runners import RunnerPhase

log = logging.getLogger("skulk.runner.fault")

PHASES: frozenset[str] = frozenset(get_args(RunnerPhase))
STARTUP_PHASES: frozenset[str] = frozenset({"created", "connect_group", "load_model", "warmup"})
_OFF = {"0", "false", "no", "off"}


class FaultError(ValueError):
    """A SKULK_FAULT value that does not parse; the message says what is wrong."""


@dataclass(frozen=True)
class Fault:
    phase: RunnerPhase
    rank: int | None = None
    after_s: float = 0.0

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_fault(value: str | None) -> Fault | None:
    """`stall:<phase>[:rank=<n>][:after=<seconds>]` → Fault; None or blank → None; anything else raises."""
    if value is None or not value.strip():
        return None
    parts = [p.strip() for p in value.strip().split(":")]
    if parts[0] != "stall":
        raise FaultError(f"unknown fault kind {parts[0]!r} (only 'stall' exists)")
    if len(parts) < 2 or parts[1] not in PHASES:
        phase = parts[1] if len(parts) > 1 else ""
        raise FaultError(f"unknown phase {phase!r}; one of: {', '.join(sorted(PHASES))}")
    options: dict[str, str] = {}
    for part in parts[2:]:
        key, sep, raw = part.partition("=")
        if not sep or key not in ("rank", "after") or key in options:
            raise FaultError(f"bad option {part!r}: expected rank=<n> or after=<seconds>, each at most once")
        options[key] = raw
    try:
        rank = int(options["rank"]) if "rank" in options else None
        after_s = float(options.get("after", "0"))
    except ValueError as exc:
        raise FaultError(f"bad number in {value!r}: {exc}") from None
    if (rank is not None and rank < 0) or not after_s >= 0 or after_s == float("inf"):
        raise FaultError(f"rank and after must be finite and non-negative in {value!r}")
    return Fault(phase=cast(RunnerPhase, parts[1]), rank=rank, after_s=after_s)


def fault_from_setting(value: str | None) -> Fault | None:
    """parse_fault for a setting read at runtime: an invalid value is logged once and means no fault."""
    try:
        return parse_fault(value)
    except FaultError as exc:
        log.error("ignoring SKULK_FAULT=%r: %s", value, exc)
        return None


def recording_enabled(value: str | None) -> bool:
    """SKULK_FLIGHT_RECORDER: recording is on unless set to 0/false/no/off (the benchmark's baseline)."""
    return value is None or value.strip().lower() not in _OFF


class FaultInjector:
    """Watches the recorder's phase changes and stalls the calling (main) thread when the fault trips."""

    def __init__(self, fault: Fault, rank: int, flush: Callable[[], None]) -> None:
        self.fault = fault
        self.rank = rank
        self.flush = flush
        self.tripped = False
        self.armed_at: float | None = time.monotonic() if fault.phase in STARTUP_PHASES else None
        self._never = threading.Event()

    def arm(self) -> None:
        """The runner is ready: serving phases may trip from now on (`after` counts from here)."""
        if self.armed_at is None:
            self.armed_at = time.monotonic()

    def should_trip(self, phase: RunnerPhase, now: float) -> bool:
        if self.tripped or phase != self.fault.phase or not self.fault.applies_to(self.rank):
            return False
        return self.armed_at is not None and now - self.armed_at >= self.fault.after_s

    def on_enter(self, phase: RunnerPhase) -> None:
        """Recorder hook, called after the entry of a new phase is queued: flush it, then stall for good."""
        if not self.should_trip(phase, time.monotonic()):
            return
        self.tripped = True
        self.flush()
        log.warning("SKULK_FAULT: rank %d stalls in %s (injected; the process stays alive)", self.rank, phase)
        while not self._never.wait(3600):
            pass
