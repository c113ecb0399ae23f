"""Inference tasks the master creates for an instance; their status is event-sourced."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

from .base import CamelModel, TaggedModel, tag_of
from .chat import ChatMessage, SamplingParams
from .ids import CommandId, InstanceId, ModelId, NodeId, TaskId


class TaskStatus(StrEnum):
    Pending = "Pending"
    Running = "Running"
    Complete = "Complete"
    Failed = "Failed"
    Cancelled = "Cancelled"

    @property
    def is_open(self) -> bool:
        return self in (TaskStatus.Pending, TaskStatus.Running)


class ChatCompletionTaskParams(CamelModel):
    """Everything prompt-bearing of one request (messages, sampling, and whatever a client API adds next to
    them). It never enters the replicated state, the master's history or a snapshot: the API node that took
    the request keeps it and serves it point to point to the nodes that run the task (cluster/payloads.py)."""

    model: ModelId
    messages: list[ChatMessage]
    sampling: SamplingParams
    tools: list[dict[str, Any]] = []
    """The tools offered (OpenAI's `tools`), rendered by the model's chat template."""
    context_limit: int | None = Field(default=None, ge=2)
    """The context every API surface advertised for the model when the request came (state.queries.served_context):
    the runner admits and generates no more, so where instances of one model differ in max_context a request is
    held to the number clients were shown. None: the instance's own."""
    template_kwargs: dict[str, Any] = {}
    """Variables for the chat template (enable_thinking, reasoning_effort, a client's chat_template_kwargs)."""


class _TaskFields(TaggedModel):
    """What every task kind carries in state; each kind adds its runner-local payload."""

    task_id: TaskId
    command_id: CommandId
    instance_id: InstanceId
    task_status: TaskStatus = TaskStatus.Pending
    model: ModelId
    origin_node_id: NodeId | None = None
    """The API node that took the request and holds its payload."""
    error_message: str | None = None
    traced: bool = False
    """Tracing was on when the master created the task: every rank records spans for it (runbook 004)."""


class ChatCompletion(_TaskFields):
    task_params: ChatCompletionTaskParams | None = Field(default=None, exclude=True)
    """Runner-local: the worker attaches the payload it fetched before handing the task to its runner.
    Excluded from every serialisation, so no event, snapshot or /state can carry a prompt even by mistake."""


class EmbeddingTaskParams(CamelModel):
    """The texts (or the model's own token ids) of one embedding request: prompt-bearing like a chat's
    messages, so it travels the same private way (cluster/payloads.py)."""

    model: ModelId
    inputs: list[str] | list[list[int]]
    truncate: bool = False
    """Cut an input longer than the model's positions (Ollama's default) instead of refusing it."""


class TextEmbedding(_TaskFields):
    """An embedding request for an instance of an embedding model; one runner answers it with one
    EmbeddingChunk. Same life in state as a ChatCompletion."""

    task_params: EmbeddingTaskParams | None = Field(default=None, exclude=True)
    """Runner-local, as ChatCompletion.task_params."""


Task = Annotated[
    Annotated[ChatCompletion, Tag("ChatCompletion")] | Annotated[TextEmbedding, Tag("TextEmbedding")],
    Discriminator(tag_of),
]
TaskParams = ChatCompletionTaskParams | EmbeddingTaskParams
