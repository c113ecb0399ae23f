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

Two more kinds act on "poisoned" requests only, those whose prompt contains the marker `SKULK_POISON` (e.g. in
the user message), so a test can send one bad request among good ones:

    SKULK_FAULT=raise:<where>[:rank=<n>]
    SKULK_FAULT=crash:poison[:rank=<n>]

- `raise:<where>` raises `InjectedFault` inside the engine for a poisoned request, at `admit` (the scheduling
  rank adds it), `sample` (the sampling rank samples its token) or `detokenize` (the sampling rank turns the
  token into text). The request must end alone with a 500 error; its batch-mates and the runner go on.
- `crash:poison` makes the runner process exit at once (`os._exit(70)`, no clean-up: a crash) the first time
  the engine touches a poisoned request on that rank (admission on rank 0, sampling on the last rank).
- `crash:hog` instead makes it allocate (and touch) memory without end on that request, as a model too big for
  its node would: inside a memory-limited cgroup the kernel's OOM killer ends it (the memory-trouble tests).

One more makes a model say what a test needs it to say (a random model never writes a tool call):

    SKULK_FAULT=script:reply[:rank=<n>]

- for a request whose prompt contains `SKULK_SCRIPT<<<text>>>` (the last one counts), the sampling rank emits
  exactly the tokens of `text`, then end-of-sequence, instead of sampling; everything after sampling
  (detokenisation, stop strings, the API's tool-call parsing and streaming) runs as for any reply. Other requests
  sample as usual. Where a reasoning budget forced the close of the reasoning (engines/reasoning.py), the script
  goes on as a model would: with its answer, the text after its own close (`</think>`, or harmony's
  `<|channel|>final<|message|>`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from skulk.types.runners import RunnerPhase

log = logging.getLogger("skulk.runner.fault")

PHASES: frozenset[str] = frozenset(get_args(RunnerPhase))
STARTUP_PHASES: frozenset[str] = frozenset({"created", "connect_group", "load_model", "warmup"})
_OFF = {"0", "false", "no", "off"}
POISON_MARKER = "SKULK_POISON"
SCRIPT = re.compile(r"SKULK_SCRIPT<<<(.*?)>>>(?!>)", re.DOTALL)  # the text may end in ">"
ANSWER_AFTER = ("</think>", "<|channel|>final<|message|>")
"""Where a scripted thinking reply's answer starts (the text after the last of these)."""
RaiseWhere = Literal["admit", "sample", "detokenize"]
WHERES: frozenset[str] = frozenset(get_args(RaiseWhere))
CRASH_EXIT_CODE = 70


class FaultError(ValueError):
    """A SKULK_FAULT value that does not parse; the message says what is wrong."""


@dataclass(frozen=True)
class Fault:
    phase: RunnerPhase
    rank: int | None = None
    after_s: float = 0.0

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


@dataclass(frozen=True)
class RaiseFault:
    """`raise:<where>[:rank=<n>]`: an exception inside the engine for poisoned requests."""

    where: RaiseWhere
    rank: int | None = None


@dataclass(frozen=True)
class CrashFault:
    """`crash:poison|hog[:rank=<n>]`: the runner process dies (exits, or eats memory until the OOM killer comes)
    when the engine touches a poisoned request."""

    rank: int | None = None
    hog: bool = False


@dataclass(frozen=True)
class ScriptFault:
    """`script:reply[:rank=<n>]`: requests carrying SKULK_SCRIPT<<<text>>> get exactly `text` as their reply."""

    rank: int | None = None


AnyFault = Fault | RaiseFault | CrashFault | ScriptFault


class InjectedFault(RuntimeError):
    """Raised on purpose by SKULK_FAULT=raise:..., to prove one request's failure stays its own."""


def _options(value: str, parts: list[str], allowed: tuple[str, ...]) -> tuple[int | None, float]:
    options: dict[str, str] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or key not in allowed or key in options:
            wanted = " or ".join(f"{k}=<n>" for k in allowed)
            raise FaultError(f"bad option {part!r}: expected {wanted}, each at most once")
        options[key] = raw
    try:
        rank = int(options["rank"]) if "rank" in options else None
        after_s = float(options.get("after", "0"))
    except ValueError as exc:
        raise FaultError(f"bad number in {value!r}: {exc}") from None
    if (rank is not None and rank < 0) or not after_s >= 0 or after_s == float("inf"):
        raise FaultError(f"rank and after must be finite and non-negative in {value!r}")
    return rank, after_s


def parse_fault(value: str | None) -> AnyFault | None:
    """`stall:<phase>[:rank=<n>][:after=<seconds>]`, `raise:<where>[:rank=<n>]` or `crash:poison[:rank=<n>]`
    → the fault; None or blank → None; anything else raises FaultError."""
    if value is None or not value.strip():
        return None
    parts = [p.strip() for p in value.strip().split(":")]
    kind, what = parts[0], parts[1] if len(parts) > 1 else ""
    if kind == "raise":
        if what not in WHERES:
            raise FaultError(f"unknown place {what!r}; one of: {', '.join(sorted(WHERES))}")
        return RaiseFault(cast(RaiseWhere, what), _options(value, parts[2:], ("rank",))[0])
    if kind == "script":
        if what != "reply":
            raise FaultError(f"unknown script target {what!r} (only 'reply')")
        return ScriptFault(_options(value, parts[2:], ("rank",))[0])
    if kind == "crash":
        if what not in ("poison", "hog"):
            raise FaultError(f"unknown crash trigger {what!r} (poison or hog)")
        return CrashFault(_options(value, parts[2:], ("rank",))[0], hog=what == "hog")
    if kind != "stall":
        raise FaultError(f"unknown fault kind {kind!r} (one of: stall, raise, crash, script)")
    if what not in PHASES:
        raise FaultError(f"unknown phase {what!r}; one of: {', '.join(sorted(PHASES))}")
    rank, after_s = _options(value, parts[2:], ("rank", "after"))
    return Fault(phase=cast(RunnerPhase, what), rank=rank, after_s=after_s)


def fault_from_setting(value: str | None) -> AnyFault | None:
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


def _eat_memory(chunk: int = 64 * 1024 * 1024) -> None:
    """Touch new memory until the kernel refuses or kills the process (a page touched is a page charged)."""
    held = []
    while True:
        block = bytearray(chunk)
        block[::4096] = b"\x01" * len(range(0, chunk, 4096))
        held.append(block)


@dataclass
class PoisonHook:
    """The engine's fault hook for `raise:` and `crash:` faults: acts on requests whose prompt decodes to text
    containing POISON_MARKER. Whether a request is poisoned is decided once per request, not per token."""

    fault: RaiseFault | CrashFault
    rank: int
    decode: Any  # Callable[[list[int]], str]: the engine's tokenizer
    _seen: dict[str, bool] = field(default_factory=dict)

    def poisoned(self, request_id: str, prompt: list[int]) -> bool:
        found = self._seen.get(request_id)
        if found is None:
            if len(self._seen) > 1024:
                self._seen.clear()
            found = self._seen[request_id] = POISON_MARKER in self.decode(prompt)
        return found

    def __call__(self, where: str, request: Any) -> None:
        fault = self.fault
        if (fault.rank is not None and fault.rank != self.rank) or not self.poisoned(
            request.request_id, request.prompt
        ):
            return
        if isinstance(fault, CrashFault):
            log.warning("SKULK_FAULT: rank %d crashes on poisoned request %s (injected)", self.rank, where)
            if fault.hog:
                _eat_memory()
            os._exit(CRASH_EXIT_CODE)
        elif fault.where == where:
            raise InjectedFault(f"injected fault at {where} on rank {self.rank} (SKULK_FAULT)")


@dataclass
class ScriptHook:
    """The engine's hook for `script:reply`: at "sample", the scripted token for this position, else None."""

    fault: ScriptFault
    rank: int
    decode: Any  # Callable[[list[int]], str]
    encode: Any  # Callable[[str], list[int]]
    eos_id: int
    _scripts: dict[str, list[int] | None] = field(default_factory=dict)

    def script(self, request_id: str, prompt: list[int]) -> list[int] | None:
        if request_id not in self._scripts:
            if len(self._scripts) > 1024:
                self._scripts.clear()
            found = SCRIPT.findall(self.decode(prompt))  # the last one: a conversation's newest turn
            self._scripts[request_id] = [*self.encode(found[-1]), self.eos_id] if found else None
        return self._scripts[request_id]

    def answer(self, request_id: str, prompt: list[int]) -> list[int] | None:
        """The script's answer alone (after its close of the reasoning), for a reply whose close was forced."""
        key = f"{request_id}/answer"
        if key not in self._scripts:
            found = SCRIPT.findall(self.decode(prompt))
            text = found[-1] if found else ""
            at = max((text.rfind(m) + len(m) for m in ANSWER_AFTER if m in text), default=-1)
            self._scripts[key] = [*self.encode(text[at:].lstrip()), self.eos_id] if at >= 0 else None
        return self._scripts[key]

    def __call__(self, where: str, request: Any) -> int | None:
        if where != "sample" or (self.fault.rank is not None and self.fault.rank != self.rank):
            return None
        tokens = self.script(request.request_id, request.prompt)
        if tokens is None:
            return None
        answer_from = getattr(request, "answer_from", None)
        answer = self.answer(request.request_id, request.prompt) if answer_from is not None else None
        if answer is not None:
            return answer[min(max(0, request.generated - answer_from), len(answer) - 1)]
        return tokens[min(request.generated, len(tokens) - 1)]


def engine_hook(fault: RaiseFault | CrashFault | ScriptFault, rank: int, tokenizer: Any) -> PoisonHook | ScriptHook:
    """The hook a runner installs in its engine for a request-level fault."""
    if isinstance(fault, ScriptFault):
        return ScriptHook(fault, rank, tokenizer.decode, tokenizer.encode, min(tokenizer.eos_ids))
    return PoisonHook(fault, rank, tokenizer.decode)
