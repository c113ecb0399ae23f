"""What rank 0 (the scheduler) tells every other rank before each step, and how it travels.

A step header is one broadcast of a fixed int64 pair [kind, payload_bytes] over the control group; only a
step that adds or releases requests pays for a second broadcast carrying the pickled changes. A steady
decode step therefore costs one tiny collective on top of the model's own traffic.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from skulk.types.chat import SamplingParams


class StepKind(IntEnum):
    HEARTBEAT = 0  # nothing to compute: lets idle ranks look at their inbox and notice a dead peer
    PREFILL = 1  # prefill the first pending request into the next free slot
    DECODE = 2  # decode one token for every running request
    SHUTDOWN = 3  # the scheduler is leaving; everyone leaves after applying the releases


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    command_id: str
    prompt: list[int]
    sampling: tuple[int, float, float, int, int | None, tuple[str, ...]]  # SamplingParams, compactly

    @classmethod
    def of(cls, request_id: str, command_id: str, prompt: list[int], s: SamplingParams) -> NewRequest:
        return cls(request_id, command_id, prompt, (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed,
                                                    tuple(s.stop)))

    def sampling_params(self) -> SamplingParams:
        max_tokens, temperature, top_p, top_k, seed, stop = self.sampling
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=list(stop)
        )


@dataclass(frozen=True, slots=True)
class Release:
    """Free a request's slot (or drop it from the queue). Every rank applies releases in header order, so
    the KV-cache slot moves they cause are the same everywhere."""

    request_id: str
    cancelled: bool
    failed: bool = False  # it raised on the sampler; the sampler's runner has reported the error


@dataclass(frozen=True, slots=True)
class Header:
    kind: StepKind
    adds: tuple[NewRequest, ...] = ()
    releases: tuple[Release, ...] = ()


# What the engine tells its runner happened to requests, so non-scheduler ranks can report tasks they never
# received from their own inbox.
@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    command_id: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Released:
    request_id: str
    command_id: str
    cancelled: bool
    failed: bool = False


RequestEvent = Admitted | Released


@dataclass
class HeaderChannel:
    """Broadcasts headers from rank 0 over the control group (gloo, CPU tensors)."""

    group: Any
    _fixed: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64))

    def send(self, header: Header) -> None:
        payload = pickle.dumps((header.adds, header.releases)) if header.adds or header.releases else b""
        self._fixed[0], self._fixed[1] = int(header.kind), len(payload)
        dist.broadcast(self._fixed, src=0, group=self.group)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.group)

    def receive(self) -> Header:
        dist.broadcast(self._fixed, src=0, group=self.group)
        kind, size = StepKind(int(self._fixed[0])), int(self._fixed[1])
        if not size:
            return Header(kind)
        data = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        adds, releases = pickle.loads(data.numpy().tobytes())
        return Header(kind, adds, releases)
