"""A chat's chunk stream ends finished when its reader stops at the last chunk (api/chat_session.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from skulk.api.chat_session import ChatSession
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId

pytestmark = pytest.mark.timeout(10)

CMD = CommandId("c1")


class _Requests:
    def __init__(self) -> None:
        self.closed: list[Any] = []
        self.cancelled: list[Any] = []

    def close(self, stream: Any) -> None:
        self.closed.append(stream)

    def cancel(self, stream: Any) -> None:
        self.cancelled.append(stream)


class _Generation:
    def __init__(self) -> None:
        self.tokens = 1
        self.outcomes: list[str] = []

    def end(self, outcome: str, *_: Any, **__: Any) -> None:
        self.outcomes.append(outcome)


def _session(first: TokenChunk, waiting: list[TokenChunk]) -> tuple[ChatSession, _Requests, _Generation]:
    requests, generation = _Requests(), _Generation()
    stream = SimpleNamespace(command_id=CMD, waiting=len(waiting),
                             take_waiting=lambda: waiting.pop(0) if waiting else None)
    node = SimpleNamespace(requests=requests)
    return ChatSession(node, stream, first, "m", generation), requests, generation  # type: ignore[arg-type]


def test_a_reader_that_stops_at_the_last_chunk_closes_it_finished_not_cancelled() -> None:
    """The finish chunk, then the reader stops (as generation.pieces does with a reply that splits) and the
    generator is closed (what the event loop does with it later): the request was completed, not cancelled."""
    last = TokenChunk(command_id=CMD, text="b", token_id=2, finish_reason="stop", completion_tokens=2)
    session, requests, generation = _session(TokenChunk(command_id=CMD, text="a", token_id=1), [last])

    async def read() -> list[str]:
        chunks = session.chunks()
        seen = []
        async for chunk in chunks:
            seen.append(chunk.text)  # type: ignore[union-attr]
            if chunk.finish_reason is not None:  # type: ignore[union-attr]
                break
        await chunks.aclose()
        return seen

    assert asyncio.run(read()) == ["a", "b"]
    assert generation.outcomes == ["stop"] and requests.cancelled == [] and len(requests.closed) == 1

