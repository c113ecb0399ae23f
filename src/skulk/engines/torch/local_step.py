"""Steps only a single rank takes: a decode step that also verifies each request's draft, prompt lookup's or a draft
model's (speculate.py holds the pure parts): greedy requests keep the prefix the target's argmax confirms, sampled
ones what the rejection rule keeps (speculate.verify_sampled). The Speculator part of TorchEngine, which the
Stepper asks first on each decode step of an engine that speculates."""

from __future__ import annotations

from collections.abc import Callable

import torch

from skulk.engines.base import TokenOut

from .drafter import DRAFT_TOKENS, Draws
from .executor import Executor
from .journal import PHASES, Journal
from .model import MIXED_STACK_ROWS
from .requests import Request, accept_each
from .sampling import distribution, greedy
from .scheduler import Scheduler
from .speculate import MAX_DRAFT, PromptLookup, accepted_prefix, verify_sampled
from .tokenizer import ChatTokenizer
from .wire import StepKind

Proposal = tuple[list[list[int]], list[Draws]]
"""A draft per running request (some empty) and, per sampled request drafted by a model, the distributions its
tokens were drawn from (drafter.Draws)."""
Finisher = Callable[[str, bool], None]
"""Releases a request that finished (or failed) in the next header: (request id, failed); admission.Inbox.finish."""


class Speculator:
    """Drafts for the running requests and the decode step that verifies them (module docstring). Single rank
    only: nothing is shared, and rank 0 is the sampler."""

    def __init__(self, scheduler: Scheduler[Request], executor: Executor, journal: Journal,
                 finish: Finisher, tokenizer: ChatTokenizer, *, kind: str, context_length: int,
                 block_size: int) -> None:
        self.scheduler, self.executor, self.journal, self.finish = scheduler, executor, journal, finish
        self.tokenizer, self.kind, self.context_length, self.block_size = tokenizer, kind, context_length, block_size

    def drafts(self) -> Proposal | None:
        """A draft per running request (some empty): the draft model's when the engine has one, else prompt
        lookup's, when none follows a grammar and at least one has a draft; None for a plain decode step. Drafts
        stop short of a request's max_tokens and context, fit the free blocks, and keep the step under
        MIXED_STACK_ROWS rows. A request that asks for log-probabilities drafts too: each accepted token's row of
        the verifying chunk is the row a plain decode step would have computed, and `emit` reports its
        log-probabilities from it (issue 43: asking for logprobs had cost a quarter of the decode rate)."""
        running, scheduler, drafter = self.scheduler.running, self.scheduler, self.executor.drafter
        if any(r.constraint is not None or r.held is not None or r.forced for r in running):  # grammar's or forced
            return None
        room, free = max(0, MIXED_STACK_ROWS // len(running) - 1), scheduler.blocks.available
        local_free = scheduler.local_blocks.available if scheduler.local_blocks is not None else 0
        most = MAX_DRAFT if drafter is None else DRAFT_TOKENS
        drafts: list[list[int]] = []
        limits: list[int] = []
        for req in running:
            if req.lookup is None:
                req.lookup = PromptLookup()
            limit = min(most, room, req.max_tokens - req.generated - 1, self.context_length - req.length - 1,
                        (len(req.table) + free) * self.block_size - req.length - 1)
            if scheduler.local_blocks is not None:  # a hybrid model's sliding table holds the draft's positions too
                limit = min(limit, (len(req.local) + local_free) * self.block_size - req.length - 1)
            draft = req.lookup.propose(req.tokens(), limit) if drafter is None else []
            limit = limit if drafter is not None and req.lookup.worth_it() else len(draft)
            limits.append(max(0, limit))
            took, local_took = scheduler.reserve(req, req.length + 1 + limits[-1])
            free, local_free = free - took, local_free - local_took
            drafts.append(draft)
        draws: list[Draws] = [None] * len(running)
        if drafter is not None:
            drafts, draws = drafter.propose(running, limits)
        return (drafts, draws) if any(drafts) else None

    def verify(self, proposal: Proposal) -> list[TokenOut]:
        """A decode step that also verifies each request's draft: its last token and draft as one chunk (a
        MixedBatch part per request), then per request the draft's prefix the target keeps (greedy: the prefix its
        argmax confirms; sampled: the rejection rule's) and one more token, each accepted as a decode step would
        accept it (speculate.py)."""
        drafts, draws = proposal
        running = self.scheduler.running
        self.journal.enter(PHASES[self.kind, StepKind.DECODE], "decode")
        for req, draft in zip(running, drafts, strict=True):
            self.scheduler.reserve(req, req.length + 1 + len(draft))
        ids, batch = self.executor.verify_batch(running, drafts, self.scheduler.local_blocks is not None)
        logits = self.executor.forward(ids, batch, (1, ids.shape[1]))
        assert logits is not None
        greedy_ids = greedy(logits[0]).tolist()
        outs: list[TokenOut] = []
        at = 0
        for req, draft, q in zip(list(running), drafts, draws, strict=True):
            rows = logits[0, at : at + len(draft) + 1]
            if req.sampling.temperature > 0:
                p = distribution(rows, [req.sampling] * len(rows))
                tokens = verify_sampled(draft, q, p, req.sampling.generator)
            else:
                tokens = greedy_ids[at : at + len(draft) + 1]
                tokens = tokens[: accepted_prefix(draft, tokens) + 1]
            keep = len(tokens) - 1
            if req.lookup is not None:
                req.lookup.record(len(draft), keep)
            if draft and self.executor.drafter is not None:  # its inputs up to the first rejected draft were right
                req.draft_len = req.length + min(keep + 1, len(draft))
            outs += self.emit(req, rows, tokens)
            at += len(draft) + 1
        return outs

    def emit(self, req: Request, rows: torch.Tensor, tokens: list[int]) -> list[TokenOut]:
        """Accept tokens[j] (chosen from rows[j]'s logits) one by one as a decode step would, until one finishes.
        No fault hook: a step with one scripts plain decode steps (step.Stepper.run)."""
        outs: list[TokenOut] = []
        for j, token in enumerate(tokens):
            req.length += 1
            out = accept_each(rows[j : j + 1], [req], self.tokenizer.eos_ids, self.context_length, None, [token])[0]
            outs.append(out)
            if not out.error:
                req.emitted.append(out.token_id)
            if out.finish_reason is not None or out.error:
                self.finish(req.request_id, bool(out.error))
                break
            if req.forced:  # a reasoning budget was reached: its close comes next, not the rest of the draft
                req.draft_len = min(req.draft_len, req.length)
                break
        return outs
