"""A step header's content: what rank 0 decides before each step and every other rank applies, as plain data.

Kept apart from wire.py (which sends it over torch.distributed) so the scheduler that builds and applies headers
(scheduler.py) imports no torch: its decisions are tested without a model or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from skulk.types.chat import SamplingParams

MAX_ADMITS = 8  # pending requests one step may admit (a burst of short prompts goes in one prefill step)
NO_COPY = (0, 0)  # an admission that copies no partial block: (block, tokens)


class WireError(RuntimeError):
    """A step header that is not one rank 0 could have sent: refused without decoding anything else."""


class StepKind(IntEnum):
    HEARTBEAT = 0  # nothing to compute: lets idle ranks look at their inbox and notice a dead peer
    PREFILL = 1  # prefill the next chunk of the prompts being prefilled (after the header's admissions)
    DECODE = 2  # decode one token for every running request past its prefill
    SHUTDOWN = 3  # the scheduler is leaving; everyone leaves after applying the releases
    MIXED = 4  # DECODE and the next PREFILL chunk in one forward pass (cache.MixedBatch): the chunk rides on it


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    command_id: str
    prompt: list[int]
    sampling: SamplingParams  # the whole validated model: a field added to it rides along on the wire
    grids: tuple[tuple[int, int, int], ...] = ()
    """Its images' (temporal, rows, columns) of merged patches, in prompt order, where the model's rope reads them
    (Qwen2.5-VL: mrope.py); () for a text prompt or a model whose rope does not."""

    @classmethod
    def of(cls, request_id: str, command_id: str, prompt: list[int], s: SamplingParams,
           grids: tuple[tuple[int, int, int], ...] = ()) -> NewRequest:
        return cls(request_id, command_id, prompt, s, grids)

    def sampling_params(self) -> SamplingParams:
        return self.sampling


@dataclass(frozen=True, slots=True)
class Release:
    """Free a request's slot (or drop it from the queue). Every rank applies releases in header order, so
    the KV-cache slot moves they cause are the same everywhere."""

    request_id: str
    cancelled: bool
    failed: bool = False  # it raised on the sampler; the sampler's runner has reported the error


@dataclass(frozen=True, slots=True)
class Preempt:
    """Take a running request back to the head of the queue; tokens: what it generated since admission, appended
    to its prompt on every rank so its recompute is the same everywhere."""

    request_id: str
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Header:
    """One step, as every rank applies it: releases, then adds, then preemptions, then admissions, then every
    running request's growth by a block where its next position needs one, then the kind's work.

    admits: pending requests moved into the next rows, in queue order: each as the cached blocks it shares for its
    first positions (empty: it starts from nothing). copies: per admission (or () for none at all), the block whose
    first `tokens` positions it copies into its first fresh block instead of computing them, as (block, tokens);
    NO_COPY for none (blocks.match_tail). chunk: the prompt tokens a PREFILL or MIXED step computes, shared by the
    requests being prefilled in row order. rows: which running rows decode (None: all of them).
    """

    kind: StepKind
    adds: tuple[NewRequest, ...] = ()
    releases: tuple[Release, ...] = ()
    chunk: int = 0
    admits: tuple[tuple[int, ...], ...] = ()
    preempts: tuple[Preempt, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    rows: tuple[int, int] | None = None
    """The running rows [start, end) this step decodes (a Pipeline's micro-batch); None: every running row."""
