"""The contract between a runner and the engine that serves its shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.chunks import TokenLogprob

FinishReason = Literal["stop", "length"]

GROUP_STEP_HEARTBEAT_S = 0.5
"""In a group of ranks (world_size > 1), rank 0 sends a step header at least this often even with nothing to
compute: the other ranks sit inside step() waiting for headers, and an empty one is when they look at their inbox
(a shutdown, a cancel). Both engines (torch, MLX) use it."""


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One generated token for one request. text is the newly decodable text (may be empty mid-codepoint).

    error: this request failed in the engine (its sampling or detokenisation raised) and is over; token_id
    and text mean nothing then. The other requests of the step are unaffected.
    """

    request_id: str
    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: TokenLogprob | None = None
    """Only for a request whose sampling asked for logprobs."""
    stop_sequence: str | None = None
    """The request's stop string that ended it (finish_reason "stop" with this set: not the model's own end)."""


class Engine(Protocol):
    """A single-rank engine with continuous batching: requests join and leave between steps."""

    context_length: int

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Apply the model's chat template (with the generation prompt, the tools offered and the request's template
        variables: enable_thinking, reasoning_effort, chat_template_kwargs) and tokenize."""
        ...

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None: ...

    def cancel(self, request_id: str) -> None:
        """Drop a request; its KV cache is freed and it yields no more tokens."""
        ...

    def has_work(self) -> bool: ...

    def step(self) -> list[TokenOut]:
        """One scheduling step: prefill newly added requests, decode one token for every running one."""
        ...

    def warmup(self) -> None:
        """Run one tiny generation so the first real request does not pay for lazy initialisation."""
        ...


@runtime_checkable
class Footprinted(Protocol):
    """An engine that can say which of its process's memory is weights and KV (the torch engine's ranks), so the
    runner can report the rest as its runtime overhead."""

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation)."""
        ...


@runtime_checkable
class Sees(Protocol):
    """An engine that reads images through the checkpoint's vision tower on rank 0 (the torch engine; the MLX
    engine for Gemma 3, engines/mlx/vision.py)."""

    def encode_images(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], Any]:
        """The prompt with each image's placeholders, and the tower's embeddings for them."""
        ...

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = "",
                    vision: Any = None) -> None:
        ...
