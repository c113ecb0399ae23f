"""One request's decoding state and the sampler's bookkeeping, shared by every engine rank that samples.

Sampling and detokenisation happen per row in isolation: an exception in one request's settings or text ends
that request only, never its batch-mates.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from skulk.engines.base import FinishReason, TokenOut
from skulk.engines.constrained import Matcher, mask_rows
from skulk.engines.harmony import HarmonySplitter
from skulk.engines.reasoning import CLOSE_TEXT, HARMONY_TO_CALL, ReasoningBudget, ReasoningSplitter
from skulk.types.chat import SamplingParams
from skulk.types.chunks import TokenLogprob, TopLogprob

from .mrope import MRope
from .sampling import RowSampling, sample, token_logprobs
from .speculate import PromptLookup
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .vision import VisionInput

Gate = ReasoningSplitter | HarmonySplitter
"""Where a reply whose grammar is held or watched is in its reasoning (held_for_reasoning)."""
FaultHook = Callable[[str, "Request"], int | None]
"""Test-only (SKULK_FAULT): called with (where, request) at "admit", "sample" and "detokenize"; may raise, and at
"sample" may return the token to emit instead of sampling (a scripted reply)."""



@dataclass(eq=False)
class Request:
    """One request's decoding state, shared by the single-rank and the distributed engines."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: RowSampling
    decoder: IncrementalDecoder
    stops: StopMatcher
    length: int = 0  # positions filled in this request's cache slot
    generated: int = 0
    last_token: int = -1
    finished: bool = False
    command_id: str = ""
    table: list[int] = field(default_factory=list)  # block table: position p lives in table[p // block_size]
    local: list[int] = field(default_factory=list)  # a hybrid model's sliding layers' table (NO_BLOCK behind)
    emitted: list[int] = field(default_factory=list)  # tokens generated since admission (ranks that embed ids)
    keys: list[int] = field(default_factory=list)  # rank 0: chain keys of its full blocks known so far
    lookup: PromptLookup | None = None  # its prompt-lookup drafts' index and acceptance (speculate.py)
    draft_len: int = 0  # positions the draft model's cache holds for it, valid (drafter.py)
    constraint: Matcher | None = None  # the sampler: its grammar (JSON, a forced tool call), engines/constrained.py
    budget: ReasoningBudget | None = None  # the sampler: its reasoning's cap (engines/reasoning.py)
    forced: list[int] = field(default_factory=list)  # the sampler: tokens to emit next instead of sampling
    answer_from: int | None = None  # `generated` once a budget's forced close is out: the answer starts there
    held: Matcher | None = None  # the sampler: a grammar that waits for the reasoning the prompt opened to close
    gate: Gate | None = None  # where the reply is in that reasoning (held_for_reasoning)
    spans: tuple[tuple[int, int], ...] = ()  # every rank: its images' placeholder runs (vision.image_spans)
    vision: VisionInput | None = None  # rank 0: its images' embeddings, one per placeholder token
    mrope: MRope | None = None  # every rank: its multimodal rope positions (mrope.py); None: plain positions

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Its token ids [start, end): the prompt's, then the generated ones (position p's KV is token p's)."""
        n = len(self.prompt)
        end = n + len(self.emitted) if end is None else end
        if end <= n:
            return self.prompt[start:end]
        return [*self.prompt[start:], *self.emitted[max(start - n, 0) : end - n]]


def reasoning_budget(s: SamplingParams, prompt: Sequence[int], tokenizer: ChatTokenizer,
                     constraint: Matcher | None = None) -> ReasoningBudget | None:
    """The cap on a request's reasoning, where it asked for one and its reply thinks (the mode the runner reports,
    from the template and the prompt's tail); a constrained reply has reasoning to cap only where its grammar waits
    for the reasoning the prompt opened (held_for_reasoning) or lets a harmony analysis message through first (its
    matcher, `constraint`: a forced harmony call), whose close is then the analysis's end alone (HARMONY_TO_CALL)."""
    if s.reasoning_budget is None:
        return None
    mode = tokenizer.reasoning_mode(prompt, tokenizer.card_reasoning)
    if mode is None:
        return None
    counted, rest = CLOSE_TEXT[mode]
    if s.constraint is not None and mode != "think_open":
        if mode != "harmony" or constraint is None or constraint.after_analysis is None:
            return None
        counted, rest = HARMONY_TO_CALL
    return ReasoningBudget(mode, s.reasoning_budget, tokenizer.encode(counted + rest), len(tokenizer.encode(counted)))


def held_for_reasoning(constraint: Matcher | None, prompt: Sequence[int], tokenizer: ChatTokenizer
                       ) -> tuple[Matcher | None, Matcher | None, Gate | None]:
    """(grammar now, grammar held, gate): a constrained reply whose prompt opened the reasoning block (`<think>` at
    the prompt's end) reasons freely first; its grammar (JSON, a forced tool call) applies to the answer, from the
    token after the close (issue 42). A forced harmony call's reply is held to its opening grammar (an analysis
    header or the call) and watched: once an analysis message opens, its grammar waits for the message's end
    (`_harmony_gate`). Any other reply that may or may not think is held to its grammar from its first token (which
    cannot open a block then)."""
    if constraint is None:
        return None, None, None
    mode = tokenizer.reasoning_mode(prompt, tokenizer.card_reasoning)
    if mode == "harmony" and constraint.after_analysis is not None:
        return constraint, None, HarmonySplitter()
    if mode != "think_open":
        return constraint, None, None
    return None, constraint, ReasoningSplitter("think_open")


def _release_grammar(req: Request, text: str) -> None:
    """A token of a reply whose grammar is held or watched (req.gate): once the reasoning has closed, and a
    budget's forced close is all out (its trailing blank line is not the grammar's), the grammar applies."""
    gate = req.gate
    assert gate is not None
    gate.push(text)
    if isinstance(gate, HarmonySplitter):
        _harmony_gate(req, gate)
    elif gate.state in ("after", "content") and not req.forced:
        req.constraint, req.held, req.gate = req.held, None, None


def _harmony_gate(req: Request, gate: HarmonySplitter) -> None:
    """A forced harmony call's reply, token by token: when its opening grammar has let an analysis message open,
    the reasoning is free and the grammar after it is held; when the message ends (the model's `<|end|>`, or a
    budget's forced one) that grammar applies, from the text the ending token brought after the end (a forced
    close's `<|start|>assistant` is then the grammar's own). A reply that went straight to the call, or whose
    grammar was dropped (a scripted token it refused), has nothing more to watch."""
    if req.held is None:
        after = req.constraint.after_analysis if req.constraint is not None else None
        if gate.state == "reasoning" and after is not None:
            req.constraint, req.held = None, after
        elif gate.state != "start":
            req.gate = None
        return
    if gate.state == "reasoning":
        return
    grammar, req.held, req.gate = req.held, None, None
    rest = gate.held if gate.state == "header" else ""
    req.constraint = grammar if grammar.advance_text(rest) else None


def _spend_reasoning(req: Request, budget: ReasoningBudget, text: str) -> None:
    """One more token of a capped reply: once the budget is reached its close is queued, and the answer follows."""
    close = budget.after(text)
    if close:
        req.forced = close
        req.answer_from = req.generated + len(close)


def accept_token(req: Request, token: int, eos_ids: Collection[int], context_length: int) -> TokenOut:
    """Record a sampled token and turn it into streamed text, deciding whether the request is done."""
    req.generated += 1
    req.last_token = token
    finish: FinishReason | None = None
    if token in eos_ids:
        text, finish = req.stops.push(req.decoder.flush())[0] + req.stops.flush(), "stop"
    else:
        text, stopped = req.stops.push(req.decoder.push(token))
        if stopped:
            finish = "stop"
        elif req.generated >= req.max_tokens or req.length + 1 >= context_length:  # this token is position length
            tail, stopped = req.stops.push(req.decoder.flush())
            text += tail if stopped else tail + req.stops.flush()
            finish = "stop" if stopped else "length"
    req.finished = finish is not None
    if req.budget is not None and not req.finished:
        _spend_reasoning(req, req.budget, text)
    return TokenOut(req.request_id, token, text, finish, stop_sequence=req.stops.matched if finish == "stop" else None)


def row_sampling(
    s: SamplingParams, vocab: int, device: torch.device, unseeded: torch.Generator
) -> RowSampling:
    """A request's sampling row. top_k above the vocabulary keeps every token, so it is clamped to it."""
    generator = unseeded
    if s.seed is not None:
        generator = torch.Generator(device=device).manual_seed(s.seed)
    return RowSampling(s.temperature, min(s.top_k, vocab), s.top_p, generator, s.logprobs)


def failed_out(req: Request, exc: BaseException) -> TokenOut:
    """The request is over with an error; its slot is released like a finished one's."""
    req.finished = True
    return TokenOut(req.request_id, -1, "", None, error=f"{type(exc).__name__}: {exc}")


def _sample_one(logits: torch.Tensor, row: RowSampling) -> int | Exception:
    try:
        return sample(logits, [row])[0]
    except Exception as exc:  # one request's settings must not fail its batch-mates
        return exc


def sample_each(logits: torch.Tensor, reqs: Sequence[Request], hook: FaultHook | None) -> list[int | Exception]:
    """One token per row, batched; only if the batch raises is each row sampled alone, so a row that raises
    gets its exception and every other row its token (the same token: each row draws from its own generator)."""
    failed: dict[int, Exception] = {}
    forced: dict[int, int] = {}
    if hook is not None:
        for i, req in enumerate(reqs):
            try:
                token = hook("sample", req)
            except Exception as exc:
                failed[i] = exc
            else:
                if token is not None:
                    forced[i] = token
    for i, req in enumerate(reqs):
        if req.forced and i not in failed:  # a reasoning budget's close (engines/reasoning.py), before any script
            forced[i] = req.forced.pop(0)
    rows = [r.sampling for r in reqs]
    try:
        tokens: list[int | Exception] = list(sample(logits, rows))
    except Exception:
        tokens = [_sample_one(logits[i : i + 1], row) for i, row in enumerate(rows)]
    return [failed.get(i, forced.get(i, token)) for i, token in enumerate(tokens)]


def accept_each(
    logits: torch.Tensor, reqs: Sequence[Request], eos_ids: Collection[int], context_length: int,
    hook: FaultHook | None, chosen: Sequence[int] | None = None,
) -> list[TokenOut]:
    """Sample and detokenise every row, each in isolation: an exception ends only its own request. chosen: the
    tokens already picked from these logits (a speculative step's), instead of sampling."""
    outs: list[TokenOut] = []
    tokens: list[int | Exception] = (list(chosen) if chosen is not None
                                     else sample_each(mask_rows(logits, [r.constraint for r in reqs]), reqs, hook))
    logprobs = logprobs_each(logits, reqs, tokens)
    for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
        if isinstance(token, Exception):
            outs.append(failed_out(req, token))
            continue
        try:
            if hook is not None:
                hook("detokenize", req)
            if req.constraint is not None and not req.constraint.advance(token):
                req.constraint = None  # a token the grammar refused (only a test's scripted one): free from here
            out = accept_token(req, token, eos_ids, context_length)
            if req.gate is not None:
                _release_grammar(req, out.text)
            reported = logprobs.get(i)
            if isinstance(reported, Exception):
                raise reported
            outs.append(out if reported is None else replace(out, logprobs=reported))
        except Exception as exc:
            outs.append(failed_out(req, exc))
    return outs


def logprobs_each(
    logits: torch.Tensor, reqs: Sequence[Request], tokens: Sequence[int | Exception]
) -> dict[int, TokenLogprob | Exception]:
    """The reported log-probabilities of the rows whose request asked for them (one batched log_softmax and
    topk over those rows only); an empty dict, at the cost of one pass over the settings, when none asked."""
    rows = [i for i, (r, t) in enumerate(zip(reqs, tokens, strict=True))
            if r.sampling.logprobs is not None and not isinstance(t, Exception)]
    if not rows:
        return {}
    picked = [t for i in rows if isinstance(t := tokens[i], int)]  # every one: rows hold no exceptions
    top = [reqs[i].sampling.logprobs or 0 for i in rows]
    try:
        index = torch.tensor(rows, device=logits.device)
        found = token_logprobs(logits.index_select(0, index), picked, top)
        return {i: _reported(reqs[i], t, f) for i, t, f in zip(rows, picked, found, strict=True)}
    except Exception as exc:  # ends the requests that asked, never their batch-mates
        return dict.fromkeys(rows, exc)


def _reported(req: Request, token: int, found: tuple[float, list[tuple[int, float]]]) -> TokenLogprob:
    logprob, top = found
    text = req.decoder.piece(token)
    return TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")),
                        top_logprobs=[_candidate(req, t, lp) for t, lp in top])


def _candidate(req: Request, token: int, logprob: float) -> TopLogprob:
    text = req.decoder.piece(token)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))
