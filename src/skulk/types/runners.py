"""Runner statuses (event-sourced) and phases (flight recorder, local to a node)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Discriminator, Tag

from .base import TaggedModel, tag_of


class RunnerIdle(TaggedModel):
    pass


class RunnerConnecting(TaggedModel):
    pass


class RunnerConnected(TaggedModel):
    pass


class RunnerLoading(TaggedModel):
    pass


class RunnerLoaded(TaggedModel):
    pass


class RunnerWarmingUp(TaggedModel):
    pass


class RunnerReady(TaggedModel):
    pass


class RunnerRunning(TaggedModel):
    pass


class RunnerShuttingDown(TaggedModel):
    pass


class RunnerShutdown(TaggedModel):
    pass


class RunnerFailed(TaggedModel):
    """at: when the worker saw it fail (restart budgets count in event time, never a clock in apply).
    attempt: the instance attempt the runner was started for; a late failure of an older attempt is stale."""

    error_message: str | None = None
    at: datetime | None = None
    attempt: int = 0


RunnerStatus = Annotated[
    Annotated[RunnerIdle, Tag("RunnerIdle")]
    | Annotated[RunnerConnecting, Tag("RunnerConnecting")]
    | Annotated[RunnerConnected, Tag("RunnerConnected")]
    | Annotated[RunnerLoading, Tag("RunnerLoading")]
    | Annotated[RunnerLoaded, Tag("RunnerLoaded")]
    | Annotated[RunnerWarmingUp, Tag("RunnerWarmingUp")]
    | Annotated[RunnerReady, Tag("RunnerReady")]
    | Annotated[RunnerRunning, Tag("RunnerRunning")]
    | Annotated[RunnerShuttingDown, Tag("RunnerShuttingDown")]
    | Annotated[RunnerShutdown, Tag("RunnerShutdown")]
    | Annotated[RunnerFailed, Tag("RunnerFailed")],
    Discriminator(tag_of),
]

RunnerPhase = Literal[
    "created",
    "idle",
    "connect_group",
    "load_model",
    "warmup",
    "task_submission",
    "task_agreement",
    "prompt_build",
    "vision_preprocess",
    "kv_cache_lookup",
    "prefill_barrier",
    "prefill_pipeline",
    "prefill_stream",
    "decode_barrier",
    "decode_wait_first_token",
    "decode_stream",
    "parser",
    "cancel_requested",
    "cancel_observed",
    "completion",
    "error",
    "shutdown_cleanup",
]
