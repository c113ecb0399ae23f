"""The work one header names, on every rank: a prefill chunk, a decode step, or both in one forward pass (MIXED);
the Stepper part of TorchEngine.

The Stepper holds no requests of its own: it reads the Scheduler's running rows, has the Executor turn the rows a
step computes into tensors and run this rank's part of the forward pass, moves the rows on, and gets the sampled
tokens to the ranks that embed the next input (now, or through Flights on rank 0 of a pipelined group). A decode
step on a single rank may verify drafts instead (local_step.Speculator).

Pipeline: rank r runs its layers and sends the hidden states on; the last rank samples and sends [token, finished,
failed] per row back to rank 0. Tensor: every rank runs all layers on its shard with a real all_reduce; the last
rank samples and broadcasts. Only the sampler's step returns TokenOuts.
"""

from __future__ import annotations

import torch

from skulk.engines.base import TokenOut

from .cache import MixedBatch, StepBatch
from .executor import Executor, PromptPart
from .flight import Flights
from .journal import PHASES, Journal
from .links import TokenRows
from .local_step import Speculator
from .options import Shard
from .requests import FaultHook, Request, accept_each
from .schedule import share_chunk
from .scheduler import Scheduler
from .tokenizer import ChatTokenizer
from .vision import whole_images
from .wire import Header, StepKind


class Stepper:
    """The forward pass of each step kind over the Scheduler's rows and the Executor (module docstring)."""

    def __init__(self, shard: Shard, scheduler: Scheduler[Request], executor: Executor, flights: Flights,
                 journal: Journal, tokenizer: ChatTokenizer, context_length: int,
                 speculator: Speculator | None) -> None:
        self.shard, self.scheduler, self.executor, self.flights = shard, scheduler, executor, flights
        self.journal, self.tokenizer, self.context_length = journal, tokenizer, context_length
        self.speculator = speculator
        """Drafts and verifies on a decode step (a single rank that speculates); None: plain decode steps."""
        self.fault_hook: FaultHook | None = None
        self.chunk_done = 0  # prompt tokens the last prefill step computed
        self.rows: tuple[int, int] | None = None  # the running rows this step decodes (None: all)

    @property
    def local(self) -> bool:
        """Whether the model keeps a sliding group's blocks apart (a hybrid model's second pool)."""
        return self.scheduler.local_blocks is not None

    def run(self, header: Header) -> list[TokenOut]:
        """The work of a PREFILL, MIXED or DECODE header (a speculative step where the decode can verify drafts)."""
        self.rows = header.rows
        if header.kind == StepKind.PREFILL:
            return self.prefill(header.chunk)
        if header.kind == StepKind.MIXED:
            return self.mixed(header.chunk)
        speculator = self.speculator if self.fault_hook is None else None  # a fault test scripts plain steps
        proposal = speculator.drafts() if speculator is not None else None
        if speculator is not None and proposal:
            return speculator.verify(proposal)
        return self.decode()

    def prefill(self, chunk: int) -> list[TokenOut]:
        """The next chunk of every prompt being prefilled (one part each, several short prompts in one pass)."""
        self.journal.enter(PHASES[self.shard.kind, StepKind.PREFILL], "prefill")
        chunks = self.chunks(chunk)
        parts = [self.executor.chunk_batch(part, self.local) for part in chunks]
        batch = parts[0] if len(parts) == 1 else MixedBatch(tuple(parts))
        logits = self.executor.forward(self.executor.inputs([], chunks), batch, (1, self.chunk_done), last_only=True)
        done = self.finish(chunks)
        if not done:
            return []
        reqs = [chunks[j][1] for j in done]
        outs = self.accept(logits[0, done].unsqueeze(1), reqs) if logits is not None else []
        if self.shard.is_scheduler and self.shard.kind == "pipeline" and self.shard.world_size > 1:
            self.journal.enter("decode_wait_first_token", "prefill_sent")
        self.share_tokens(reqs, outs)
        return outs

    def mixed(self, chunk: int) -> list[TokenOut]:
        """A decode step of every running request and the next chunk of the prompts being prefilled, in one
        forward pass (cache.MixedBatch): the chunks ride on the decode step's read of the weights."""
        self.journal.enter(PHASES[self.shard.kind, StepKind.DECODE], "decode")
        chunks = self.chunks(chunk)
        # a row being prefilled decodes too (its token is dropped): its write at its length is overwritten by its
        # chunk, this step or a later one
        decode, last_tokens, rows = self.decode_rows()
        batch = MixedBatch((decode, *(self.executor.chunk_batch(part, self.local) for part in chunks)))
        n = len(last_tokens)
        logits = self.executor.forward(self.executor.inputs(last_tokens, chunks), batch, (1, n + self.chunk_done),
                                       last_only=True)
        decoding = self.advance(rows)
        done = self.finish(chunks)
        reqs = [*decoding, *(chunks[j][1] for j in done)]
        outs: list[TokenOut] = []
        if logits is not None:  # rows: one per running request, then each chunk's last token
            outs = self.accept(logits[0, [*rows, *(n + j for j in done)]].unsqueeze(1), reqs)
        self.share_tokens(reqs, outs)
        return outs

    def chunks(self, chunk: int) -> list[PromptPart]:
        """The prompt parts this step prefills (schedule.share_chunk), with chunk_done set to their tokens."""
        prefilling = [(i, r) for i, r in enumerate(self.scheduler.running) if r.length < len(r.prompt)]
        shares = share_chunk([len(r.prompt) - r.length for _, r in prefilling], chunk)
        shares = [whole_images(r.spans, r.length, take) if r.spans else take
                  for (_, r), take in zip(prefilling, shares, strict=True)]
        self.chunk_done = sum(shares)
        return [(i, r, r.length, r.length + take) for (i, r), take in zip(prefilling, shares, strict=True) if take]

    def finish(self, chunks: list[PromptPart]) -> list[int]:
        """Advance each chunk's request to its end (publishing its new full blocks for sharing); the indices of the
        chunks that completed their prompt."""
        for _, req, _, end in chunks:
            req.length = end
            self.scheduler.publish(req)
        return [j for j, (_, req, _, end) in enumerate(chunks) if end == len(req.prompt)]

    def decode(self) -> list[TokenOut]:
        """One token for every decoding row of this step's rows."""
        self.journal.enter(PHASES[self.shard.kind, StepKind.DECODE], "decode")
        batch, last_tokens, rows = self.decode_rows()
        ids = torch.tensor(last_tokens, device=self.executor.device).unsqueeze(1) if self.executor.needs_ids else None
        logits = self.executor.forward(ids, batch, (len(last_tokens), 1))
        decoding = self.advance(rows)
        if logits is not None and len(rows) < len(last_tokens):
            logits = logits[rows]
        outs = self.accept(logits, decoding) if logits is not None else []
        self.share_tokens(decoding, outs, decode=True)
        return outs

    def decode_rows(self) -> tuple[StepBatch, list[int], list[int]]:
        """A decode row per running request of this step's rows (the header's; all of them in the plain schedule):
        the batch, each row's input token (a row still being prefilled has none yet: any id will do, its output is
        dropped) and the indices, within the batch, of the rows that sample."""
        running = self.scheduler.running
        start, end = self.rows or (0, len(running))
        running = running[start:end]
        batch = self.executor.decode_batch(running, self.local)
        rows = [i for i, r in enumerate(running) if r.length >= len(r.prompt)]
        return batch, [max(r.last_token, 0) for r in running], rows

    def advance(self, rows: list[int]) -> list[Request]:
        """The requests of the sampling rows (indices within this step's rows), each one position further along."""
        start = self.rows[0] if self.rows else 0
        decoding = [self.scheduler.running[start + i] for i in rows]
        for req in decoding:
            req.length += 1
        return decoding

    def share_tokens(self, reqs: list[Request], outs: list[TokenOut], *, decode: bool = False) -> None:
        """Get [token, finished, failed] per row from the sampler to the ranks that embed the next input: now, or
        for rank 0 of a pipelined group when it needs them (flight.py). decode: a decode step alone (its tokens'
        trip is the group's pace, flight.Pace)."""
        if not reqs:
            return
        rows: TokenRows | None = None
        if self.shard.is_sampler:
            rows = [[0, 1, 1] if o.error else [o.token_id, int(o.finish_reason is not None), 0] for o in outs]
        pending = self.executor.link.exchange_tokens(rows, len(reqs))
        if pending is not None:
            self.flights.fly(reqs, pending, decode)

    def accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping: text, finish and per-request failure (requests.py)."""
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
