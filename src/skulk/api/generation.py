"""The one path every text API shares (OpenAI, Claude Messages, Ollama, Responses, legacy completions).

Each router turns its request into a ChatCompletionRequest, starts it with `start_chat` (errors before the first
token are ApiErrors, which each router writes in its own error shape), then reads `deltas` or `collect` and only
formats. The chunk loop, the cancel-on-abandon behaviour (ChatSession.close) and the split of a thinking model's
reasoning from its answer (`pieces`, engines/reasoning.py: the runner's first chunk says how the reply splits) live
here once.

A reasoning budget (Anthropic's `thinking.budget_tokens`) ends the generation when the reasoning reaches it: the
reply then finishes as if max_tokens had been hit (finish_reason "length"), its reasoning cut there and no answer.
Forcing `</think>` into the engine's output instead would let the model answer; that is not done here."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from skulk.api.chat_session import ChatSession
from skulk.engines.reasoning import ReasoningSplitter
from skulk.types.chunks import ErrorChunk, RequestStats, TokenChunk, TokenLogprob


class GenerationFailed(Exception):
    """The request ended in error after it started streaming (a lost node, a session change, an engine fault)."""

    def __init__(self, chunk: ErrorChunk) -> None:
        super().__init__(chunk.message)
        self.chunk = chunk


@dataclass(slots=True)
class Finished:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats | None
    started: float
    """time.monotonic() when the request was started, for APIs that report durations."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per generated token when the request asked for logprobs."""
    stop_sequence: str | None = None
    """The stop string that ended the reply, if one did (TokenChunk.stop_sequence)."""
    reasoning: str = ""
    """The reply's reasoning, apart from its text (empty for a model that does not think)."""
    reasoning_tokens: int = 0

    @property
    def total_ns(self) -> int:
        return int((time.monotonic() - self.started) * 1e9)


async def deltas(session: ChatSession) -> AsyncIterator[TokenChunk]:
    """Chunks that carry text or logprobs, and always the last one (its finish_reason and counts);
    GenerationFailed on error."""
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            raise GenerationFailed(chunk)
        if chunk.text or chunk.finish_reason is not None or chunk.logprobs is not None:
            yield chunk


@dataclass(slots=True)
class Piece:
    """One chunk's share of the reply: its answer text and its reasoning text (either may be empty)."""

    chunk: TokenChunk
    text: str
    reasoning: str


async def pieces(session: ChatSession, budget: int | None = None) -> AsyncIterator[Piece]:
    """Like `deltas`, with the reasoning split from the text; session.reasoning_tokens counts the tokens spent
    inside the reasoning (its tags included). `budget`: the most reasoning tokens (the module's docstring)."""
    splitter = ReasoningSplitter(session.first.reasoning) if session.first.reasoning is not None else None
    pending = 0
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            raise GenerationFailed(chunk)
        if splitter is None:
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs is not None:
                yield Piece(chunk, chunk.text, "")
            continue
        was, undecided = splitter.in_reasoning, splitter.state == "start"
        reasoning, text = splitter.push(chunk.text) if chunk.text else ("", "")
        if splitter.state == "start":
            pending += 1  # maybe the open tag's first pieces: counted once the block opens
        elif was or splitter.in_reasoning or (undecided and splitter.state == "after"):
            session.reasoning_tokens += 1 + pending
            pending = 0
        elif undecided:
            pending = 0
        if chunk.finish_reason is None and budget is not None and splitter.in_reasoning \
                and session.reasoning_tokens >= budget:
            session.close()  # cancels the generation: the budget is spent
            chunk = chunk.model_copy(update={"finish_reason": "length", "stop_sequence": None})
        if chunk.finish_reason is not None:
            held_reasoning, held_text = splitter.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
        if text or reasoning or chunk.finish_reason is not None or chunk.logprobs is not None:
            yield Piece(chunk, text, reasoning)
        if chunk.finish_reason is not None:
            return


async def collect(session: ChatSession, budget: int | None = None, *, split: bool = True) -> Finished:
    """The whole answer of a non-streaming request; split=False keeps any reasoning in the text (legacy
    completions, which have no place for it)."""
    started = time.monotonic()
    parts: list[str] = []
    thoughts: list[str] = []
    logprobs: list[TokenLogprob] = []
    last: TokenChunk | None = None
    stream = pieces(session, budget) if split else (Piece(c, c.text, "") async for c in deltas(session))
    async for piece in stream:
        parts.append(piece.text)
        thoughts.append(piece.reasoning)
        if piece.chunk.logprobs is not None:
            logprobs.append(piece.chunk.logprobs)
        last = piece.chunk
    assert last is not None and last.finish_reason is not None
    return Finished("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats,
                    started, logprobs, last.stop_sequence, "".join(thoughts), session.reasoning_tokens)
