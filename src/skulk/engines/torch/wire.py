"""What rank 0 (the scheduler) tells every other rank before each step, and how it travels.

A step header is fixed int64s [kind, payload_bytes, chunk, admissions, rows_start, rows_end] over the control
group; only a step that adds, releases or preempts requests, or admits one onto cached prefix blocks, pays for a
second message carrying the changes as JSON. A steady decode step therefore costs one tiny message on top of the
model's own traffic. rows_start/rows_end name the running rows the step decodes (a Pipeline's micro-batch);
rows_end ALL_ROWS (-1) is every running row, the unpipelined schedule and what a Tensor group always sends.

Two channels carry it. A Tensor group broadcasts (`HeaderChannel`): every rank computes every step together.
A Pipeline posts it from rank 0 to each other rank (`PostedHeaders`), and each of them has already posted the
receive for its next header before it computes the current step. Gloo's send waits for the receiver to have
posted its receive, so a header (or a hidden state) sent to a rank that is still busy would otherwise cost the
sender a round trip, and a broadcast would hold rank 0 until the slowest rank is done: rank 0 could never run
ahead by a micro-batch.

The changes are JSON validated into a fixed pydantic model (`StepChanges`), never pickle: any peer that can
reach the group's sockets could otherwise run code in this rank by sending a crafted header. A header whose
kind is unknown, whose size is out of bounds or whose payload does not validate raises `WireError`, which
fails the rank like any other group error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from skulk.types.chat import SamplingParams

from .delay import DelayedSends, after_collective
from .header import MAX_ADMITS, NO_COPY, Header, NewRequest, Preempt, Release, StepKind, WireError

__all__ = ["MAX_ADMITS", "NO_COPY", "Header", "NewRequest", "Preempt", "Release", "StepKind", "WireError"]

MAX_CHANGES_BYTES = 256 * 1024 * 1024  # one step's adds, prompts included; a larger size is a forged header
FIXED_INTS = 6  # [kind, payload_bytes, chunk, admissions, rows_start, rows_end]
ALL_ROWS = -1  # rows_end of a step that decodes every running row
MAX_ROWS = 1 << 20  # a row index beyond this is a forged header (the engine checks against its own rows too)
HEADER_TAG, PAYLOAD_TAG = 1, 2  # point-to-point tags of a posted header's fixed part and its payload


# What the engine tells its runner happened to requests, so non-scheduler ranks can report tasks they never
# received from their own inbox.
@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    command_id: str
    prompt_tokens: int
    at: float = 0.0
    """perf_counter() when this rank applied the header that admitted it: where its prefill clock starts (the
    runner learns of it only after the step, by when the prefill is done; issue 27's prompt_tps)."""
    prompt_tail: tuple[int, ...] = ()
    """The prompt's last tokens and whether the reply is constrained: a rank that did not render the prompt (the
    sampler of a group) decides from them how the reply's reasoning splits (engines/reasoning.py)."""
    constrained: bool = False


@dataclass(frozen=True, slots=True)
class Released:
    request_id: str
    command_id: str
    cancelled: bool
    failed: bool = False


@dataclass(frozen=True, slots=True)
class Started:
    """The request took a cache slot and its prefill began, from reused_tokens positions of a retained prefix."""

    request_id: str
    command_id: str
    reused_tokens: int


RequestEvent = Admitted | Started | Released


class _WireAdd(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(max_length=256)
    command_id: str = Field(max_length=256)
    prompt: list[int]
    sampling: SamplingParams
    grids: list[tuple[int, int, int]] = Field(default=[], max_length=64, exclude_if=lambda g: not g)


class _WireRelease(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(max_length=256)
    cancelled: bool
    failed: bool = False


class _WirePreempt(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str = Field(max_length=256)
    tokens: list[int]


class StepChanges(BaseModel):
    """The variable part of a step header, exactly as it travels."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    adds: list[_WireAdd] = []
    releases: list[_WireRelease] = []
    shared: list[list[int]] = Field(default=[], max_length=MAX_ADMITS)  # per admission: the cached blocks it shares
    preempts: list[_WirePreempt] = []
    copies: list[tuple[int, int]] = Field(default=[], max_length=MAX_ADMITS)  # per admission: (block, tokens)


def has_changes(header: Header) -> bool:
    """Whether the header needs its payload (a steady decode step does not)."""
    return bool(header.adds or header.releases or header.preempts or any(header.admits) or _copies(header))


def _copies(header: Header) -> bool:
    return any(copy != NO_COPY for copy in header.copies)


def encode_changes(header: Header) -> bytes:
    changes = StepChanges(
        adds=[_WireAdd(request_id=a.request_id, command_id=a.command_id, prompt=a.prompt,
                       sampling=a.sampling_params(), grids=list(a.grids)) for a in header.adds],
        releases=[_WireRelease(request_id=r.request_id, cancelled=r.cancelled, failed=r.failed)
                  for r in header.releases],
        shared=[list(blocks) for blocks in header.admits] if any(header.admits) else [],
        preempts=[_WirePreempt(request_id=p.request_id, tokens=list(p.tokens)) for p in header.preempts],
        copies=list(header.copies) if _copies(header) else [],
    )
    return changes.model_dump_json(by_alias=True).encode()


def decode_changes(payload: bytes, admissions: int) -> Header:
    """Validate a payload into a header's changes (kind and chunk left to the caller); anything else is a WireError
    (nothing is constructed but these plain records)."""
    try:
        changes = StepChanges.model_validate_json(payload)
    except ValidationError as exc:
        raise WireError(f"malformed step header payload ({len(payload)} bytes): {exc.error_count()} errors") from None
    if changes.shared and len(changes.shared) != admissions:
        raise WireError(f"step header shares blocks for {len(changes.shared)} of {admissions} admissions")
    adds = tuple(NewRequest.of(a.request_id, a.command_id, a.prompt, a.sampling, tuple(a.grids))
                 for a in changes.adds)
    releases = tuple(Release(r.request_id, r.cancelled, r.failed) for r in changes.releases)
    if changes.copies and len(changes.copies) != admissions:
        raise WireError(f"step header copies blocks for {len(changes.copies)} of {admissions} admissions")
    admits = tuple(tuple(b) for b in changes.shared) if changes.shared else ((),) * admissions
    preempts = tuple(Preempt(p.request_id, tuple(p.tokens)) for p in changes.preempts)
    copies = tuple(changes.copies) if changes.copies else (NO_COPY,) * admissions
    return Header(StepKind.HEARTBEAT, adds, releases, 0, admits, preempts, copies)


def decode_fixed(kind: int, size: int, admits: int = 0, rows: tuple[int, int] = (0, ALL_ROWS)) -> tuple[StepKind, int]:
    """Check the fixed part before allocating anything for the payload."""
    try:
        step = StepKind(kind)
    except ValueError:
        raise WireError(f"unknown step kind {kind}") from None
    if not 0 <= size <= MAX_CHANGES_BYTES:
        raise WireError(f"step header payload size {size} out of bounds (0...{MAX_CHANGES_BYTES})")
    if not 0 <= admits <= MAX_ADMITS:
        raise WireError(f"step header admits {admits} requests (0...{MAX_ADMITS})")
    start, end = rows
    if not ((end == ALL_ROWS and start == 0) or 0 <= start <= end <= MAX_ROWS):
        raise WireError(f"step header decodes rows [{start}, {end})")
    return step, size


def fixed_ints(header: Header, payload: bytes) -> list[int]:
    start, end = header.rows if header.rows is not None else (0, ALL_ROWS)
    return [int(header.kind), len(payload), header.chunk, len(header.admits), start, end]


def parse(fixed: list[int], read_payload: Callable[[int], bytes]) -> Header:
    """A header from its fixed ints, reading its payload (of the size they announce, once they are checked)."""
    raw_kind, size, chunk, count, start, end = fixed
    kind, size = decode_fixed(raw_kind, size, count, (start, end))
    rows = None if end == ALL_ROWS else (start, end)
    if not size:
        return Header(kind, chunk=chunk, admits=((),) * count, copies=(NO_COPY,) * count, rows=rows)
    changes = decode_changes(read_payload(size), count)
    return Header(kind, changes.adds, changes.releases, chunk, changes.admits, changes.preempts, changes.copies, rows)


def _payload(header: Header) -> bytes:
    return encode_changes(header) if has_changes(header) else b""


@dataclass
class HeaderChannel:
    """Broadcasts headers from rank 0 over the control group (gloo, CPU tensors): a Tensor group."""

    group: Any
    delay_s: float = 0.0
    """Bench-only emulated one-way latency (delay.py): a receiver takes each header that much later."""
    _fixed: torch.Tensor = field(default_factory=lambda: torch.zeros(FIXED_INTS, dtype=torch.int64))

    def send(self, header: Header) -> None:
        payload = _payload(header)
        self._fixed.copy_(torch.tensor(fixed_ints(header, payload), dtype=torch.int64))
        dist.broadcast(self._fixed, src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> Header:
        dist.broadcast(self._fixed, src=0, group=self.group)
        if self.delay_s:
            after_collective(self.delay_s, 1)
        return parse(self._fixed.tolist(), self._read_payload)

    def _read_payload(self, size: int) -> bytes:
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        return data.numpy().tobytes()


def settle(sending: list[tuple[Any, torch.Tensor]], keep: int) -> None:
    """Wait on the oldest sends beyond the newest `keep`. Gloo marks a point-to-point send complete only when it is
    waited on, so sends are kept (with their tensors) until then; the oldest of more than a pipeline's depth has
    long been received (rank 0 runs at most one step per rank ahead), so waiting on it costs nothing."""
    while len(sending) > keep:
        work, _ = sending.pop(0)
        work.wait()


class PostedHeaders:
    """Headers from rank 0 to every other rank of a Pipeline, point to point, without waiting on any of them.

    Rank 0 isends and goes on (the sends it keeps until they complete); each other rank keeps the receive of its
    next header posted while it computes, so a header never waits for its receiver (module docstring)."""

    def __init__(self, group: Any, rank: int, world_size: int, delay: DelayedSends | None = None) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.delay = delay  # bench-only emulated latency (delay.py)
        self._sending: list[tuple[Any, torch.Tensor]] = []
        self._next: tuple[Any, torch.Tensor] | None = None

    def send(self, header: Header) -> None:
        payload = _payload(header)
        fixed = torch.tensor(fixed_ints(header, payload), dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
        for peer in range(1, self.world_size):
            self._sending.append((self._isend(fixed, peer, HEADER_TAG), fixed))
            if data is not None:
                self._sending.append((self._isend(data, peer, PAYLOAD_TAG), data))
        settle(self._sending, 2 * self.world_size * self.world_size)

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        if self.delay is None:
            return dist.isend(tensor, peer, group=self.group, tag=tag)
        return self.delay.post(lambda: dist.isend(tensor, peer, group=self.group, tag=tag))

    def flush(self) -> None:
        """Wait until every header sent has left (before the group is torn down)."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []

    def receive(self) -> Header:
        work, fixed = self._next if self._next is not None else self._post()
        work.wait()
        header = parse(fixed.tolist(), self._read_payload)
        self._next = self._post() if header.kind != StepKind.SHUTDOWN else None
        return header

    def _post(self) -> tuple[Any, torch.Tensor]:
        fixed = torch.empty(FIXED_INTS, dtype=torch.int64)
        return dist.irecv(fixed, 0, group=self.group, tag=HEADER_TAG), fixed

    def _read_payload(self, size: int) -> bytes:
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, 0, group=self.group, tag=PAYLOAD_TAG)
        return data.numpy().tobytes()
