"""The runner of an embedding model: one process, one node, one request at a time, answered whole.

It is a `Runner` (same queues, heartbeat, flight recorder, statuses and warmup deadline) with its own load and
serve loop: an embedding request is one batched forward, not a decode loop, so it runs when it is taken from
the inbox and its vectors go back in one `EmbeddingChunk`. The phases it passes are the seeds' names: a task
goes `task_submission` → `prompt_build` (tokenize) → `prefill_stream` (the forward) → `completion`.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from skulk.engines.torch.embedding import EmbeddingEngine, EmbeddingRefused
from skulk.runner.core import Runner
from skulk.runner.messages import CancelTask, RunTask, Shutdown, TaskAccepted, TaskEnded, Tokens, ToRunner
from skulk.types.chunks import EmbeddingChunk
from skulk.types.errors import ErrorCode
from skulk.types.runners import (
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerWarmingUp,
)
from skulk.types.tasks import ChatCompletion, TaskStatus, TextEmbedding

log = logging.getLogger("skulk.runner")


def pack_vectors(rows: Any) -> str:
    """float32 rows, little-endian, base64: the EmbeddingChunk layout."""
    return base64.b64encode(rows.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")


class EmbeddingRunner(Runner):
    embedder: EmbeddingEngine | None = None

    def start(self) -> None:
        from skulk.models.demo import ensure_builtin_model

        self.recorder.record("created", "process_started")
        self.set_status(RunnerLoading())
        self.recorder.record("load_model", "load_started", str(self.spec.model_dir))
        self.flush()
        card = self.spec.shard.model_card
        if card.builtin:
            ensure_builtin_model(card.model_id, self.spec.model_dir.parent)
        self.embedder = EmbeddingEngine(self.spec.model_dir)
        self.recorder.record("load_model", "load_finished", with_memory=True)
        self.set_status(RunnerLoaded())
        self.set_status(RunnerWarmingUp())
        self.recorder.record("warmup", "warmup_started")
        self.flush()
        self._warmup_with_deadline(self.embedder)
        self.recorder.record("warmup", "warmup_finished", with_memory=True)
        self.recorder.record("idle", "ready")
        self.set_status(RunnerReady())
        self.flush()

    def serve(self) -> None:
        while not self.stopping:
            self._take_messages(block=True)
            self.flush()
        self.recorder.record("shutdown_cleanup", "shutdown")
        self.set_status(RunnerShutdown())
        self.flush()

    def _handle(self, message: ToRunner) -> None:
        match message:
            case RunTask(task=TextEmbedding() as task):
                self._embed(task)
            case RunTask(task=ChatCompletion() as task):
                self._fail(task.task_id, task.command_id, f"{task.model} is an embedding model: it cannot chat; "
                           "send its requests to POST /v1/embeddings", code=ErrorCode.model_not_chat)
            case CancelTask(task_id=task_id):
                # a request is answered whole inside the call that took it: by now it is over
                self.recorder.record("cancel_requested", "cancel_after_completion", task_id=task_id)
            case Shutdown():
                self.stopping = True

    def _embed(self, task: TextEmbedding) -> None:
        assert self.embedder is not None
        ids: dict[str, Any] = dict(task_id=task.task_id, command_id=task.command_id)
        params = task.task_params  # attached by the worker from the API node's payload; never in state
        assert params is not None, "a task reached the runner without its payload"
        self.recorder.record("task_submission", "task_received", inputs=len(params.inputs), **ids)
        self.send(TaskAccepted(task.task_id))
        self.set_status(RunnerRunning())
        self.recorder.record("prefill_stream", "embedding", **ids)
        started = time.perf_counter()
        try:
            vectors, tokens = self.embedder.embed(params.inputs, truncate=params.truncate)
        except EmbeddingRefused as refused:
            self._fail(task.task_id, task.command_id, str(refused), code=ErrorCode.invalid_request)
        except Exception as exc:  # this request alone fails; the runner goes on
            self._fail_in_engine(task.task_id, task.command_id, exc)
        else:
            chunk = EmbeddingChunk(command_id=task.command_id, count=vectors.shape[0], dimension=vectors.shape[1],
                                   vectors=pack_vectors(vectors), prompt_tokens=tokens)
            self.send(Tokens([chunk]))
            self.send(TaskEnded(task.task_id, task.command_id, TaskStatus.Complete))
            self.recorder.record("completion", "task_complete", prompt_tokens=tokens,
                                 ms=round((time.perf_counter() - started) * 1e3, 1), **ids)
        self.set_status(RunnerReady())
