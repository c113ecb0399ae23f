"""Rank 0's step headers and every rank's application of them, over the engine's Scheduler (scheduler.py): the
Admission part of TorchEngine, with the Inbox it leads from.

The Scheduler owns the queue, the running rows and the block tables and makes every scheduling decision without
tensors. Admission gives it what only the engine has: requests with their sampling state (new_request), the steps
still in flight (flight.Flights), the measured timings that size a prefill chunk (timing.StepTimes), the link that
sends and receives headers, and the Executor's KV cache, which performs the block copies an admission asks for. It
also records what happened to requests for the runner (journal.Journal: wire.Admitted, Started, Released).

Rank 0 (lead) turns the Inbox's adds and releases into a header, has the Scheduler plan preemptions and admissions
against the pool, and sends it; every other rank (follow) applies the same header to its own Scheduler, in the
same order, so queues, rows and block tables stay identical without further agreement.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Sequence

import torch

from skulk.engines.constrained import Grammars, tool_call_style
from skulk.engines.errors import PromptRejected
from skulk.types.chat import SamplingParams

from .core import WARMUP_ID
from .executor import Executor
from .flight import Flights
from .journal import Journal
from .links import TokenRows
from .mrope import mrope_index
from .options import Shard
from .requests import FaultHook, Request, held_for_reasoning, reasoning_budget, row_sampling
from .scheduler import Dropped, Scheduled, Scheduler, StepPlan
from .timing import StepTimes
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .vision import VisionInput, image_chunk, image_spans
from .wire import Admitted, Header, NewRequest, Release, Released, Started, StepKind

log = logging.getLogger(__name__)


class Inbox:
    """Rank 0's requests and releases for the next header, and the images of requests added until they leave.

    Its own part because three others fill it: add_request and cancel (through Admission), the tokens that come
    back from the sampler (land: a finished row is released) and a speculative step's accepted tokens."""

    def __init__(self, is_scheduler: bool) -> None:
        self.is_scheduler = is_scheduler
        self.adds: list[NewRequest] = []
        self.releases: list[Release] = []
        self.visions: dict[str, VisionInput] = {}  # added requests' image embeddings, until released

    def take(self) -> Header:
        """The adds and releases queued since the last header, as a header's changes; the inbox empties."""
        changes = Header(StepKind.HEARTBEAT, tuple(self.adds), tuple(self.releases))
        self.adds, self.releases = [], []
        return changes

    def finish(self, request_id: str, failed: bool) -> None:
        """Release a request that finished (or failed on the sampler) in the next header."""
        self.releases.append(Release(request_id, cancelled=False, failed=failed))

    def land(self, reqs: Sequence[Request | None], rows: TokenRows) -> None:
        """Record [token, finished, failed] per row on a rank that embeds the next input (flight.Lander). A row that
        failed on the sampler is finished too: rank 0 releases it in the next header, so every rank frees its slot,
        while its batch-mates go on."""
        for req, (token, finished, failed) in zip(reqs, rows, strict=True):
            if req is None:
                continue
            req.last_token = token
            if not failed:
                req.emitted.append(token)
            if self.is_scheduler and finished:
                req.finished = True
                self.finish(req.request_id, bool(failed))

    def cancel(self, request_id: str) -> None:
        """Drop a request not yet sent in a header, else release it in the next one."""
        before = len(self.adds)
        self.adds = [a for a in self.adds if a.request_id != request_id]
        if len(self.adds) < before:
            self.visions.pop(request_id, None)
        else:
            self.releases.append(Release(request_id, cancelled=True))


class Admission:
    """Headers led and followed over the Scheduler, and the requests they add (module docstring)."""

    def __init__(self, shard: Shard, scheduler: Scheduler[Request], executor: Executor, flights: Flights,
                 inbox: Inbox, journal: Journal, times: StepTimes, tokenizer: ChatTokenizer) -> None:
        self.shard, self.scheduler, self.executor, self.flights = shard, scheduler, executor, flights
        self.inbox, self.journal, self.times, self.tokenizer = inbox, journal, times, tokenizer
        self.warming = False  # until the warmup request is released
        self.last_header = 0.0  # rank 0: when it last sent one (a group's heartbeat)
        self._unseeded = torch.Generator(device=executor.device).manual_seed(secrets.randbits(63))

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str,
            vision: VisionInput | None, fault_hook: FaultHook | None) -> None:
        """Rank 0: queue the request for the next header, once it is known to build (TorchEngine.add_request)."""
        if vision is not None:
            spans = image_spans(prompt_ids, self.executor.model.args.image_token_id)
            if sum(e - s for s, e in spans) != vision.embeds.shape[0]:
                raise PromptRejected("the prompt's image placeholders do not match its images")
            self.inbox.visions[request_id] = vision  # its grids travel in the header (mrope.py); new_request checks
        known = {r.request_id for r in (*self.scheduler.pending, *self.scheduler.running)}
        if request_id in known | {a.request_id for a in self.inbox.adds}:
            raise ValueError(f"request {request_id!r} is already running")
        add = NewRequest.of(request_id, command_id, list(prompt_ids), sampling, vision.grids if vision else ())
        try:
            req = self.new_request(add)  # what every rank will build from the header: if it raises, it does here
            if fault_hook is not None:
                fault_hook("admit", req)
        except BaseException:
            self.inbox.visions.pop(request_id, None)
            raise
        self.inbox.adds.append(add)

    def lead(self) -> Header:
        """Rank 0: the next step's header, applied here and sent to every other rank."""
        inbox = self.inbox
        self.flights.take_due(startable=bool(inbox.adds or inbox.releases or self.scheduler.rests()))
        if self.flights.in_flight and self.scheduler.short_of_blocks():
            self.flights.drain()  # a preemption may follow: it carries its victim's tokens, so all must be back
        changes = inbox.take()
        self.apply(changes)
        done = self.scheduler.schedule(changes, self.plan, self.flights.drain)
        self.carry_out(done)
        self.executor.link.send_header(done.header)
        self.last_header = time.monotonic()
        return done.header

    def follow(self) -> Header:
        """Every other rank: rank 0's next header, applied to this rank's Scheduler."""
        header = self.executor.link.receive_header()
        self.apply(header)
        self.carry_out(self.scheduler.update(header))
        return header

    def plan(self) -> StepPlan:
        """Rank 0, once preemptions are planned: the rows the step decodes (flight.py: a micro-batch, or every
        decoding row) and its prefill chunk (StepTimes.chunk from the measured step times; raised to a whole image
        the first prompt being prefilled starts with)."""
        rows = self.flights.decode_range()
        decoding = rows is not None
        chunk = self.times.chunk(decoding)
        head = next((r for r in self.scheduler.running if r.length < len(r.prompt)), None)  # the chunk goes to it
        if head is not None and head.spans:
            chunk = image_chunk(chunk, head.spans, head.length, self.times.prefill_chunk)
        return StepPlan(decoding, chunk, rows if self.flights.pipelined and decoding else None)  # None: every row

    def carry_out(self, done: Scheduled[Request]) -> None:
        """The tensor side of a scheduled step: the KV block copies its admissions asked for, in order, and a
        Started event per admitted request."""
        for copy in done.copies:
            self.executor.copy_block(copy.source, copy.dest, copy.group)
        for req in done.started:
            if req.request_id != WARMUP_ID:
                self.journal.events.append(Started(req.request_id, req.command_id, req.length))

    def apply(self, header: Header) -> None:
        """The header's releases and adds, applied by the Scheduler, recorded for the runner."""
        self.scheduler.apply(header, self.new_request, self.release)
        for add in header.adds:
            if add.request_id != WARMUP_ID:
                self.journal.events.append(Admitted(add.request_id, add.command_id, len(add.prompt),
                                                    time.perf_counter(), tuple(add.prompt[-8:]),
                                                    add.sampling.constraint is not None))

    def new_request(self, add: NewRequest) -> Request:
        """The request every rank builds from a header's add: its sampling rows, decoder, stops, grammar (where
        this rank samples or checks it) and images."""
        s, shard, args = add.sampling_params(), self.shard, self.executor.model.args
        row = row_sampling(s, args.vocab_size, self.executor.device, self._unseeded)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        stops = StopMatcher(s.stop)
        constraint = None
        if s.constraint is not None and (shard.is_sampler or shard.is_scheduler):  # rank 0 checks it compiles
            harmony = self.tokenizer.reasoning_mode(add.prompt, self.tokenizer.card_reasoning) == "harmony"
            constraint = self.grammars.matcher(s.constraint, harmony_reply=harmony)
        budget = reasoning_budget(s, add.prompt, self.tokenizer, constraint) if shard.is_sampler else None
        constraint, held, gate = held_for_reasoning(constraint, add.prompt, self.tokenizer)
        spans = image_spans(add.prompt, args.image_token_id)
        return Request(add.request_id, add.prompt, s.max_tokens, row, decoder, stops, command_id=add.command_id,
                       constraint=constraint, budget=budget, held=held, gate=gate, spans=spans,
                       vision=self.inbox.visions.get(add.request_id),
                       mrope=mrope_index(len(add.prompt), spans, add.grids))

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        tok, args = self.tokenizer, self.executor.model.args
        style = tool_call_style(args.model_type, tok.renders_tools, tok.template_text, tok.card_tool_parser)
        return Grammars(tok.hf, args.vocab_size, tok.eos_ids, style)

    def release(self, drop: Dropped[Request]) -> None:
        """A release as the Scheduler applied it: its images dropped, a running request's speculative acceptance
        counted, and the runner told (the warmup request ends warming instead)."""
        self.inbox.visions.pop(drop.release.request_id, None)
        found = drop.seq
        if found is None:
            return
        if drop.running and found.lookup is not None and found.lookup.drafted:
            lookup = found.lookup
            self.journal.spec_drafted += lookup.drafted
            self.journal.spec_accepted += lookup.accepted
            log.info("MTP acceptance %.0f %% for %s: %d of %d %s draft tokens accepted",
                     100 * lookup.accepted / lookup.drafted, found.request_id, lookup.accepted, lookup.drafted,
                     "prompt-lookup" if self.executor.drafter is None else "draft-model")
        if found.request_id == WARMUP_ID:
            self.warming = False
        else:
            self.journal.events.append(Released(found.request_id, found.command_id, drop.release.cancelled,
                                                drop.release.failed))
