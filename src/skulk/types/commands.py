"""Commands: imperative requests to the master, which validates them and answers with events."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Tag

from .base import TaggedModel, tag_of
from .chat import ChatMessage, SamplingParams
from .ids import CommandId, InstanceId, ModelId, NodeId
from .instances import Instance


class CreateInstance(TaggedModel):
    """Place an instance the API already planned against the same state the master holds."""

    command_id: CommandId
    instance: Instance


class DeleteInstance(TaggedModel):
    command_id: CommandId
    instance_id: InstanceId


class StartChatCompletion(TaggedModel):
    command_id: CommandId
    model: ModelId
    messages: list[ChatMessage]
    sampling: SamplingParams
    instance_id: InstanceId | None = None


class CancelCommand(TaggedModel):
    command_id: CommandId
    target_command_id: CommandId


Command = Annotated[
    Annotated[CreateInstance, Tag("CreateInstance")]
    | Annotated[DeleteInstance, Tag("DeleteInstance")]
    | Annotated[StartChatCompletion, Tag("StartChatCompletion")]
    | Annotated[CancelCommand, Tag("CancelCommand")],
    Discriminator(tag_of),
]


class ForwardedCommand(TaggedModel):
    origin: NodeId
    command: Command
