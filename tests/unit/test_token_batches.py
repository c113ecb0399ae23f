"""Token batching on the API node (issue 43): `piece_batches` hands a route every piece of the chunks already
waiting on the stream at once, so a stream behind its runner costs one socket write per batch, not per token.
Batching must keep every piece, its order and the finish reason exactly as `pieces` gives them, never hold a piece
while it waits for a later chunk, send what came before an error first, and leave the OpenAI stream's bytes as
they were; the same for the Responses API's typed events and the legacy completions' chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import pytest

from skulk.api import claude as claude_route
from skulk.api import ollama as ollama_route
from skulk.api import openai as openai_route
from skulk.api import responses as completions_route
from skulk.api import responses_api
from skulk.api.chat_session import ChatSession
from skulk.api.generation import GenerationFailed, Piece, piece_batches, pieces
from skulk.api.tool_calls import ToolFormat
from skulk.types.chat import ChatCompletionRequest
from skulk.types.chunks import ErrorChunk, TokenChunk, TokenLogprob
from skulk.types.ids import CommandId
from skulk.types.responses import CompletionRequest, ResponsesRequest
from tests.unit.test_tool_parsers import SCHEMAS

pytestmark = pytest.mark.timeout(30)

CID = CommandId("c1")


class ArrivingSession:
    """What the routes read of a ChatSession, with chunks arriving in `groups`: the chunks of a group wait on the
    stream together (ready() is True inside a group), and reading past a group's end is a wait (logged)."""

    def __init__(self, groups: list[list[TokenChunk | ErrorChunk]]) -> None:
        self.groups = groups
        first = groups[0][0]
        assert isinstance(first, TokenChunk)
        self.first = first
        self.command_id = CID
        self.reasoning_tokens = 0
        self.log: list[str] = []
        self._left = 0
        self.closed = False

    async def chunks(self) -> AsyncIterator[TokenChunk | ErrorChunk]:
        try:
            for n, group in enumerate(self.groups):
                if n:
                    self.log.append("wait")
                    await asyncio.sleep(0)
                for i, chunk in enumerate(group):
                    self._left = len(group) - i - 1
                    yield chunk
        finally:
            self.closed = True

    def ready(self) -> bool:
        return self._left > 0

    def close(self) -> None:
        self.closed = True


def chunk(text: str, i: int, finish: str | None = None, reasoning: str | None = None) -> TokenChunk:
    return TokenChunk.model_validate({"command_id": CID, "text": text, "token_id": i, "prompt_tokens": 3,
                                      "completion_tokens": i + 1, "finish_reason": finish, "reasoning": reasoning})


def grouped(texts: list[str], sizes: list[int], reasoning: str | None = None) -> list[list[TokenChunk | ErrorChunk]]:
    chunks: list[TokenChunk | ErrorChunk] = [
        chunk(t, i, "stop" if i == len(texts) - 1 else None, reasoning if i == 0 else None)
        for i, t in enumerate(texts)]
    groups, at = [], 0
    for size in sizes:
        groups.append(chunks[at:at + size])
        at += size
    assert at == len(chunks)
    return groups


def shape(p: Piece) -> tuple[str, str, str | None]:
    return p.text, p.reasoning, p.chunk.finish_reason


async def _batches(session: ArrivingSession) -> list[list[tuple[str, str, str | None]]]:
    out = []
    async for batch in piece_batches(cast(ChatSession, session)):
        session.log.append(f"batch {len(batch)}")
        out.append([shape(p) for p in batch])
    return out


async def _pieces(session: ArrivingSession) -> list[tuple[str, str, str | None]]:
    return [shape(p) async for p in pieces(cast(ChatSession, session))]


TEXTS = ["<think>", "a", "b</th", "ink>", "Hel", "", "lo", " wor", "ld", "!"]
GROUPINGS = [[1] * 10, [10], [1, 3, 2, 4], [2, 2, 2, 2, 2], [1, 9], [9, 1]]


@pytest.mark.parametrize("sizes", GROUPINGS, ids=["-".join(map(str, s)) for s in GROUPINGS])
@pytest.mark.parametrize("reasoning", [None, "think"])
def test_batches_keep_every_piece_in_order_with_the_finish(sizes: list[int], reasoning: str | None) -> None:
    """However the chunks arrive, the batches flattened are `pieces`' pieces (reasoning split across chunks and
    batches alike), the reasoning tokens are counted the same, and the last piece carries the finish reason."""
    alone = ArrivingSession(grouped(TEXTS, [1] * len(TEXTS), reasoning))
    expected = asyncio.run(_pieces(alone))
    session = ArrivingSession(grouped(TEXTS, sizes, reasoning))
    batches = asyncio.run(_batches(session))
    assert [p for b in batches for p in b] == expected
    assert session.reasoning_tokens == alone.reasoning_tokens
    assert expected[-1][2] == "stop" and all(b for b in batches)
    assert len(batches) <= len(sizes)  # one batch per arrival at most: the waiting chunks went out together


def test_a_batch_goes_out_before_any_wait() -> None:
    """A piece is never held while the stream waits for a later chunk: even when the last waiting chunk gives no
    piece (empty text), the batch before it is handed over before the next chunk is awaited."""
    session = ArrivingSession(grouped(["a", "b", "", "c", "d"], [3, 2]))
    asyncio.run(_batches(session))
    assert session.log == ["batch 2", "wait", "batch 2"]


def test_what_came_before_an_error_goes_out_first() -> None:
    """An error behind pieces in one batch: the pieces are handed over, then GenerationFailed."""
    error = ErrorChunk(command_id=CID, message="lost the node")
    session = ArrivingSession([[chunk("a", 0), chunk("b", 1), error]])
    got: list[list[tuple[str, str, str | None]]] = []

    async def read() -> None:
        async for batch in piece_batches(cast(ChatSession, session)):
            got.append([shape(p) for p in batch])

    with pytest.raises(GenerationFailed):
        asyncio.run(read())
    assert got == [[("a", "", None), ("b", "", None)]]


def test_a_client_gone_mid_batch_closes_the_stream() -> None:
    """The reader stops after its first batch (the client went away): the session's chunk stream is closed."""
    session = ArrivingSession(grouped(["a", "b", "c", "d"], [2, 2]))

    async def first_only() -> None:
        batches = cast(AsyncGenerator[list[Piece], None], piece_batches(cast(ChatSession, session)))
        await anext(batches)
        await batches.aclose()

    asyncio.run(first_only())
    assert session.closed


def _openai_bytes(groups: list[list[TokenChunk | ErrorChunk]], extra: dict[str, Any]) -> tuple[str, int]:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    "stream": True, **extra})
    session = ArrivingSession(groups)

    async def read() -> list[str]:
        return [e async for e in openai_route._stream_events(cast(ChatSession, session), request, None)]

    writes = asyncio.run(read())
    return "".join(writes), len(writes)


@pytest.mark.parametrize("reasoning", [None, "think"])
def test_openai_stream_bytes_do_not_depend_on_batching(reasoning: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same events byte for byte, each its own `data:` line, whether every token came alone or all at once;
    batched, they take fewer writes."""
    monkeypatch.setattr(openai_route.time, "time", lambda: 1_700_000_000.0)  # one `created` for both streams
    extra = {"stream_options": {"include_usage": True}}
    one_by_one, writes_alone = _openai_bytes(grouped(TEXTS, [1] * len(TEXTS), reasoning), extra)
    together, writes_together = _openai_bytes(grouped(TEXTS, [len(TEXTS)], reasoning), extra)
    assert together == one_by_one
    assert together.endswith("data: [DONE]\n\n") and together.count("data: {") == one_by_one.count("data: {")
    assert writes_together < writes_alone


def _route_bytes(route: str, groups: list[list[TokenChunk | ErrorChunk]]) -> tuple[str, int]:
    session = cast(ChatSession, ArrivingSession(groups))
    events = (claude_route._events(session, "m", None) if route == "claude"
              else ollama_route._ndjson(session, "m", ollama_route._chat_shape, None, 0.0))

    async def read() -> list[str]:
        return [e async for e in events]

    writes = asyncio.run(read())
    return "".join(writes), len(writes)


@pytest.mark.parametrize("route", ["claude", "ollama"])
@pytest.mark.parametrize("reasoning", [None, "think"])
def test_claude_and_ollama_bytes_do_not_depend_on_batching(route: str, reasoning: str | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """/v1/messages' events and /api/chat's lines are the same bytes whether the tokens came alone or all at
    once; batched, they take fewer writes."""
    monkeypatch.setattr(ollama_route, "_now", lambda: "2026-12-06T00:00:00Z")
    monkeypatch.setattr(ollama_route.time, "monotonic", lambda: 5.0)  # the done line's durations
    one_by_one, writes_alone = _route_bytes(route, grouped(TEXTS, [1] * len(TEXTS), reasoning))
    together, writes_together = _route_bytes(route, grouped(TEXTS, [len(TEXTS)], reasoning))
    assert together == one_by_one
    assert "lo wor" not in together and writes_together < writes_alone  # each token still its own event/line


def _logprob(text: str) -> TokenLogprob:
    return TokenLogprob(token=text, logprob=-0.5, bytes=list(text.encode()),
                        top_logprobs=[TokenLogprob(token=text, logprob=-0.5, bytes=list(text.encode()))])


def _with_logprobs(groups: list[list[TokenChunk | ErrorChunk]]) -> list[list[TokenChunk | ErrorChunk]]:
    return [[c.model_copy(update={"logprobs": _logprob(c.text)}) if isinstance(c, TokenChunk) else c for c in g]
            for g in groups]


async def _writes(events: AsyncIterator[str]) -> list[str]:
    return [e async for e in events]


def _completion_writes(groups: list[list[TokenChunk | ErrorChunk]], extra: dict[str, Any]) -> list[str]:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream": True, **extra})
    return asyncio.run(_writes(completions_route._completion_events(cast(ChatSession, ArrivingSession(groups)),
                                                                    body)))


def _response_writes(groups: list[list[TokenChunk | ErrorChunk]], tools: bool = False) -> list[str]:
    session = cast(ChatSession, ArrivingSession(groups))
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "stream": True, "store": False})
    builder = responses_api.ResponseBuilder(session, body, ToolFormat("hermes", SCHEMAS) if tools else None, None)
    return asyncio.run(_writes(responses_api.response_events(session, builder, cast(Any, None))))


COMPLETION_CASES = {"plain": {}, "usage": {"stream_options": {"include_usage": True}},
                    "logprobs": {"logprobs": 2, "stream_options": {"include_usage": True}}}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
@pytest.mark.parametrize("reasoning", [None, "think"])
@pytest.mark.parametrize("sizes", GROUPINGS[1:], ids=["-".join(map(str, s)) for s in GROUPINGS[1:]])
def test_completions_stream_bytes_do_not_depend_on_batching(sizes: list[int], reasoning: str | None, case: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """/v1/completions: the same chunks byte for byte (the reasoning left in the text, logprob offsets running on
    across batches, the usage and [DONE] after the last) however the tokens arrive; the chunks waiting together
    take one write, so all ten at once are one write, [DONE] included."""
    monkeypatch.setattr(completions_route.time, "time", lambda: 1_700_000_000.0)
    extra = COMPLETION_CASES[case]
    shaped = _with_logprobs if "logprobs" in extra else (lambda g: g)
    alone = _completion_writes(shaped(grouped(TEXTS, [1] * len(TEXTS), reasoning)), extra)
    batched = _completion_writes(shaped(grouped(TEXTS, sizes, reasoning)), extra)
    assert "".join(batched) == "".join(alone)
    assert len(batched) <= len(sizes) < len(alone)
    assert len(batched) == 1 or sizes != [len(TEXTS)]
    events = [json.loads(line[6:]) for line in "".join(batched).splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "".join(TEXTS)
    assert "".join(batched).endswith("data: [DONE]\n\n") and "".join(batched).count("[DONE]") == 1
    if "logprobs" in extra:
        offsets = [e["choices"][0]["logprobs"]["text_offset"][0] for e in events if e["choices"]]
        assert offsets == [sum(map(len, TEXTS[:i])) for i in range(len(TEXTS))]


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("reasoning", [None, "think"])
@pytest.mark.parametrize("sizes", GROUPINGS[1:], ids=["-".join(map(str, s)) for s in GROUPINGS[1:]])
def test_responses_stream_bytes_do_not_depend_on_batching(sizes: list[int], reasoning: str | None, logprobs: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """/v1/responses: the same typed events byte for byte (sequence numbers, the reasoning item before the
    message, each delta its own event) however the tokens arrive; the pieces waiting together take one write,
    the two opening events one and the closing events one."""
    monkeypatch.setattr(responses_api.time, "time", lambda: 1_700_000_000.0)
    shaped = _with_logprobs if logprobs else (lambda g: g)
    alone = _response_writes(shaped(grouped(TEXTS, [1] * len(TEXTS), reasoning)))
    batched = _response_writes(shaped(grouped(TEXTS, sizes, reasoning)))
    assert "".join(batched) == "".join(alone)
    assert len(batched) <= 2 + len(sizes) < len(alone)
    assert len(batched) == 3 or sizes != [len(TEXTS)]
    kinds = [line[7:] for line in "".join(batched).splitlines() if line.startswith("event: ")]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    expected = asyncio.run(_pieces(ArrivingSession(grouped(TEXTS, [1] * len(TEXTS), reasoning))))
    assert kinds.count("response.output_text.delta") == sum(1 for text, _, _ in expected if text)  # one per token
    assert kinds.count("response.reasoning_text.delta") == sum(1 for _, thought, _ in expected if thought)


TOOL_TEXTS = ["Let me check. ", "<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>", "\nAnd ", "<tool_call>\n", '{"name": "get_time", "arguments": {"tz": "UTC"}}',
              "\n</tool_call>", " done."]


@pytest.mark.parametrize("sizes", [[10], [3, 3, 4], [5, 5], [2, 8]], ids=["10", "3-3-4", "5-5", "2-8"])
def test_responses_tool_call_events_do_not_depend_on_batching(sizes: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Function-call items streamed from a batch: the same events as one by one (the message closed before the
    first call, each call's four events, the text after them an item of its own)."""
    monkeypatch.setattr(responses_api.time, "time", lambda: 1_700_000_000.0)
    alone = _response_writes(grouped(TOOL_TEXTS, [1] * len(TOOL_TEXTS)), tools=True)
    batched = _response_writes(grouped(TOOL_TEXTS, sizes), tools=True)
    assert "".join(batched) == "".join(alone)
    assert len(batched) <= min(2 + len(sizes), len(alone))  # held text makes some tokens eventless
    assert len(batched) == 3 < len(alone) or sizes != [len(TOOL_TEXTS)]
    assert "".join(alone).count("event: response.function_call_arguments.done") == 2


@pytest.mark.parametrize("route", ["completions", "responses"])
def test_an_error_behind_waiting_tokens_keeps_the_bytes(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens waiting ahead of an error: their events, then the error, the same bytes as one by one."""
    monkeypatch.setattr(completions_route.time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(responses_api.time, "time", lambda: 1_700_000_000.0)
    error = ErrorChunk(command_id=CID, message="lost the node")
    chunks: list[TokenChunk | ErrorChunk] = [chunk("a", 0), chunk("b", 1), error]
    writes = (lambda g: _completion_writes(g, {})) if route == "completions" else _response_writes
    alone, batched = writes([[c] for c in chunks]), writes([chunks])
    assert "".join(batched) == "".join(alone) and len(batched) < len(alone)
    assert "lost the node" in "".join(batched)
