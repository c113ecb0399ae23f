"""Stored responses of the Responses API: what `previous_response_id` continues and `GET /v1/responses/{id}`
returns.

A response is stored (unless its request said `store: false`) on the node that answered it, in memory, with the
conversation it ended: the earlier turns, its input, and its output as an assistant turn. Bounds, so a client
cannot grow a node without end: a response is kept for `MAX_AGE_S` (1 hour) after it was created, at most
`MAX_RESPONSES` (1024) of them and `MAX_BYTES` (64 MiB of their JSON) together; past either bound the oldest go
first. A node restart forgets them. Any other node finds them on their holder (response_peers.py), so a client
may continue a response through any node. With API keys on, a response belongs to the key that created it:
another inference key gets the same 404 (an admin key reads all)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from skulk.api.security import CURRENT, Access
from skulk.types.chat import ChatMessage
from skulk.types.errors import ApiError, ErrorCode

MAX_AGE_S = 3600.0
MAX_RESPONSES = 1024
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Stored:
    response: str
    """The response object as JSON text, exactly as it was answered."""
    conversation: tuple[ChatMessage, ...]
    """Every turn up to and including this response's output (without instructions, which do not carry over)."""
    created: float
    size: int
    owner: str | None = None
    """The fingerprint of the API key that created it (None: keys are off)."""


class ResponseStore:
    def __init__(self, *, max_age_s: float = MAX_AGE_S, max_responses: int = MAX_RESPONSES,
                 max_bytes: int = MAX_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s, self.max_responses, self.max_bytes = max_age_s, max_responses, max_bytes
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, response: str, conversation: list[ChatMessage], owner: str | None = None
            ) -> None:
        size = len(response) + sum(len(m.model_dump_json()) for m in conversation)
        if size > self.max_bytes:
            return  # one response larger than the whole store: answered, never kept
        self._drop(response_id)
        self._items[response_id] = Stored(response, tuple(conversation), self.clock(), size, owner)
        self._bytes += size
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._drop(response_id)

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._items and next(iter(self._items.values())).created < oldest:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> bool:
        gone = self._items.pop(response_id, None)
        if gone is not None:
            self._bytes -= gone.size
        return gone is not None


def check_owner(found: Stored | None) -> Stored | None:
    """The response if the request's key may see it: its creator's key, or an admin key (keys off: anyone)."""
    viewer = CURRENT.get()
    if found is not None and found.owner is not None and viewer.access < Access.ADMIN and viewer.key_id != found.owner:
        return None
    return found


def not_found(response_id: str, param: str | None, max_age_s: float) -> ApiError:
    """The 404 that says why a response may be missing (the same for another key's response)."""
    what = f"previous_response_id: no response found with id {response_id!r}" if param else \
        f"no response found with id {response_id!r}"
    return ApiError(ErrorCode.response_not_found,
                    f"{what} on any node of the cluster (a response is kept for {int(max_age_s)} s on the node that "
                    "answered it, unless created with store: false, and is lost when that node restarts or leaves)")
