"""The one path every text API shares (OpenAI, Claude Messages, Ollama, Responses, legacy completions).

Each router turns its request into a ChatCompletionRequest, starts it with `start_chat` (errors before the first
token are ApiErrors, which each router writes in its own error shape), then reads `deltas` or `collect` and only
formats. The chunk loop, the cancel-on-abandon behaviour (ChatSession.close) and the split of a thinking model's
reasoning from its answer (`pieces`, engines/reasoning.py: the runner's first chunk says how the reply splits) live
here once.

A reasoning budget (Anthropic's `thinking.budget_tokens`) is not kept here: it travels in the sampling parameters
to the rank that samples, which forces the family's close of the reasoning when the budget is reached, so the model
answers after it (engines/reasoning.py's ReasoningBudget). The count here is the same one (ReasoningTally)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from skulk.api.chat_session import ChatSession
from skulk.engines.reasoning import ReasoningTally
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


class _Split:
    """`pieces`' reading of one chunk after another: the reasoning split from the text, the reasoning tokens counted
    on the session. `done` once a reply that splits has its last piece. split=False reads every chunk as `deltas`
    does, the reasoning left in the text (legacy completions)."""

    def __init__(self, session: ChatSession, split: bool = True) -> None:
        self.session = session
        reasoning = session.first.reasoning
        self.tally = ReasoningTally(reasoning) if split and reasoning is not None else None
        self.done = False

    def take(self, chunk: TokenChunk) -> Piece | None:
        tally = self.tally
        if tally is None:
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs is not None:
                return Piece(chunk, chunk.text, "")
            return None
        reasoning, text = tally.push(chunk.text)
        self.session.reasoning_tokens = tally.tokens
        if chunk.finish_reason is not None:
            held_reasoning, held_text = tally.splitter.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
            self.done = True
        if text or reasoning or chunk.finish_reason is not None or chunk.logprobs is not None:
            return Piece(chunk, text, reasoning)
        return None


async def pieces(session: ChatSession) -> AsyncIterator[Piece]:
    """Like `deltas`, with the reasoning split from the text; session.reasoning_tokens counts the tokens spent
    inside the reasoning (its tags included)."""
    split = _Split(session)
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            raise GenerationFailed(chunk)
        piece = split.take(chunk)
        if piece is not None:
            yield piece
        if split.done:
            return


async def piece_batches(session: ChatSession, *, split: bool = True) -> AsyncIterator[list[Piece]]:
    """`pieces` in batches: every piece of the chunks already waiting on the stream, so that a stream behind its
    runner (a speculative step's several tokens, a busy event loop) writes them to its client at once, each
    still its own event (issue 43: a socket write per token was most of the API's cost per token). A batch goes
    out before any wait for the next chunk and before an error, so no piece ever waits on a later one.
    split=False: `deltas` in batches, each chunk's text whole in its piece, reasoning included (as `collect`'s)."""
    reader = _Split(session, split)
    batch: list[Piece] = []
    async for chunk in session.chunks():
        if isinstance(chunk, ErrorChunk):
            if batch:
                yield batch
            raise GenerationFailed(chunk)
        piece = reader.take(chunk)
        if piece is not None:
            batch.append(piece)
        if reader.done:
            break
        if batch and not session.ready():
            yield batch
            batch = []
    if batch:
        yield batch


async def collect(session: ChatSession, *, split: bool = True) -> Finished:
    """The whole answer of a non-streaming request; split=False keeps any reasoning in the text (legacy
    completions, which have no place for it)."""
    started = time.monotonic()
    parts: list[str] = []
    thoughts: list[str] = []
    logprobs: list[TokenLogprob] = []
    last: TokenChunk | None = None
    stream = pieces(session) if split else (Piece(c, c.text, "") async for c in deltas(session))
    async for piece in stream:
        parts.append(piece.text)
        thoughts.append(piece.reasoning)
        if piece.chunk.logprobs is not None:
            logprobs.append(piece.chunk.logprobs)
        last = piece.chunk
    assert last is not None and last.finish_reason is not None
    return Finished("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats,
                    started, logprobs, last.stop_sequence, "".join(thoughts), session.reasoning_tokens)
