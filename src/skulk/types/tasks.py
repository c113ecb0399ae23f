"""Inference tasks the master creates for an instance; their status is event-sourced."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Discriminator, Tag

from .base import CamelModel, TaggedModel, tag_of
from .chat import ChatMessage, SamplingParams
from .ids import CommandId, InstanceId, ModelId, TaskId


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
    model: ModelId
    messages: list[ChatMessage]
    sampling: SamplingParams


class ChatCompletion(TaggedModel):
    task_id: TaskId
    command_id: CommandId
    instance_id: InstanceId
    task_status: TaskStatus = TaskStatus.Pending
    task_params: ChatCompletionTaskParams
    error_message: str | None = None
    traced: bool = False
    """Tracing was on when the master created the task: every rank records spans for it (runbook 004)."""


Task = Annotated[Annotated[ChatCompletion, Tag("ChatCompletion")], Discriminator(tag_of)]
