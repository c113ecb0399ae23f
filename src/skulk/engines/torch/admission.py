"""Rank 0's step headers and every rank's application of them, over the engine's Scheduler (scheduler.py).

The Scheduler owns the queue, the running rows and the block tables and makes every scheduling decision without
tensors. This layer gives it what only the engine has: requests with their sampling state (_new_request), the
steps still in flight (flight.Flights), the measured timings that size a prefill chunk, the link that sends and
receives headers, and the Executor's KV cache, which performs the block copies an admission asks for. It also
records what happened to requests for the runner (wire.Admitted, Started, Released).

Rank 0 (_lead) turns queued adds and releases into a header, has the Scheduler plan preemptions and admissions
against the pool, and sends it; every other rank (_follow) applies the same header to its own Scheduler, in the
same order, so queues, rows and block tables stay identical without further agreement.
"""

from __future__ import annotations

import functools
import logging
import time

from skulk.engines.constrained import Grammars, tool_call_style

from .core import WARMUP_ID, EngineCore
from .mrope import mrope_index
from .requests import Request, held_for_reasoning, reasoning_budget, row_sampling
from .schedule import chunk_tokens
from .scheduler import Dropped, Scheduled, StepPlan
from .tokenizer import IncrementalDecoder, StopMatcher
from .vision import image_chunk, image_spans
from .wire import Admitted, Header, NewRequest, Released, Started, StepKind

log = logging.getLogger(__name__)


class Admission(EngineCore):
    def _lead(self) -> Header:
        self._sync_scheduler()
        self.flights.take_due(startable=bool(self._adds or self._releases or self.scheduler.rests()))
        if self.flights.in_flight and self.scheduler.short_of_blocks():
            self.flights.drain()  # a preemption may follow: it carries its victim's tokens, so all must be back
        changes = Header(StepKind.HEARTBEAT, tuple(self._adds), tuple(self._releases))
        self._adds, self._releases = [], []
        self._apply(changes)
        done = self.scheduler.schedule(changes, self._plan, self._drain_some)
        self._carry_out(done)
        header = done.header
        self._step_rows = header.rows
        self.link.send_header(header)
        self._last_header = time.monotonic()
        return header

    def _follow(self) -> Header:
        self._sync_scheduler()
        header = self.link.receive_header()
        self._apply(header)
        self._carry_out(self.scheduler.update(header))
        self._step_rows = header.rows
        return header

    def _sync_scheduler(self) -> None:
        """share_prefixes is the engine's to set (a mixed instance turns it off after construction): the
        Scheduler reads it from here, each step."""
        self.scheduler.share_prefixes = self.share_prefixes

    def _plan(self) -> StepPlan:
        """Rank 0, once preemptions are planned: the rows the step decodes (flight.py: a micro-batch, or every
        decoding row) and its prefill chunk (schedule.chunk_tokens from the measured step times; raised to a
        whole image the first prompt being prefilled starts with)."""
        rows = self.flights.decode_range()
        decoding = rows is not None
        chunk = chunk_tokens(self.prefill_chunk, decoding=decoding, decode_s=self._decode_s,
                             last_chunk=self._last_chunk)
        head = next((r for r in self._running if r.length < len(r.prompt)), None)  # the chunk goes to it first
        if head is not None and head.spans:
            chunk = image_chunk(chunk, head.spans, head.length, self.prefill_chunk)
        return StepPlan(decoding, chunk, rows if self.flights.pipelined and decoding else None)  # None: every row

    def _drain_some(self) -> bool:
        """Take every step in flight, if any (the Scheduler's drain before a preemption)."""
        return self.flights.drain()

    def _carry_out(self, done: Scheduled[Request]) -> None:
        """The tensor side of a scheduled step: the KV block copies its admissions asked for, in order, and a
        Started event per admitted request."""
        for copy in done.copies:
            self.executor.copy_block(copy.source, copy.dest, copy.group)
        for req in done.started:
            if req.request_id != WARMUP_ID:
                self._events.append(Started(req.request_id, req.command_id, req.length))

    def _apply(self, header: Header) -> None:
        """The header's releases and adds, applied by the Scheduler, recorded for the runner."""
        self.scheduler.apply(header, self._new_request, self._release)
        for add in header.adds:
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt), time.perf_counter(),
                                             tuple(add.prompt[-8:]), add.sampling.constraint is not None))

    def _new_request(self, add: NewRequest) -> Request:
        s = add.sampling_params()
        row = row_sampling(s, self.model.args.vocab_size, self.device, self._unseeded)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        stops = StopMatcher(s.stop)
        constraint = None
        if s.constraint is not None and (self.is_sampler or self.is_scheduler):  # rank 0 checks it compiles
            harmony = self.tokenizer.reasoning_mode(add.prompt, self.tokenizer.card_reasoning) == "harmony"
            constraint = self.grammars.matcher(s.constraint, harmony_reply=harmony)
        budget = reasoning_budget(s, add.prompt, self.tokenizer, constraint) if self.is_sampler else None
        constraint, held, gate = held_for_reasoning(constraint, add.prompt, self.tokenizer)
        spans = image_spans(add.prompt, self.model.args.image_token_id)
        return Request(add.request_id, add.prompt, s.max_tokens, row, decoder, stops, command_id=add.command_id,
                       constraint=constraint, budget=budget, held=held, gate=gate, spans=spans,
                       vision=self._visions.get(add.request_id), mrope=mrope_index(len(add.prompt), spans, add.grids))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        style = tool_call_style(self.model.args.model_type, self.tokenizer.renders_tools,
                                self.tokenizer.template_text, self.tokenizer.card_tool_parser)
        return Grammars(self.tokenizer.hf, self.model.args.vocab_size, self.tokenizer.eos_ids, style)

    def _release(self, drop: Dropped[Request]) -> None:
        """A release as the Scheduler applied it: its images dropped, a running request's speculative acceptance
        counted, and the runner told (the warmup request ends warming instead)."""
        self._visions.pop(drop.release.request_id, None)
        found = drop.seq
        if found is None:
            return
        if drop.running and found.lookup is not None and found.lookup.drafted:
            lookup = found.lookup
            self.spec_drafted += lookup.drafted
            self.spec_accepted += lookup.accepted
            log.info("MTP acceptance %.0f %% for %s: %d of %d %s draft tokens accepted",
                     100 * lookup.accepted / lookup.drafted, found.request_id, lookup.accepted, lookup.drafted,
                     "prompt-lookup" if self.drafter is None else "draft-model")
        if found.request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(found.request_id, found.command_id, drop.release.cancelled,
                                         drop.release.failed))

    def _publish(self, req: Request) -> None:
        """Rank 0: key the request's full blocks for sharing (Scheduler.publish)."""
        self.scheduler.publish(req)
