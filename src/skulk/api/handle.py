"""What the API needs from its node, and nothing more: read state, send commands, stream chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from skulk.cluster.dataplane import ChunkStream
from skulk.config import Settings
from skulk.types.commands import Command
from skulk.types.ids import CommandId, NodeId
from skulk.types.state import State
from skulk.types.tasks import TaskParams


class NodeHandle(Protocol):
    node_id: NodeId
    settings: Settings

    @property
    def state(self) -> State: ...

    @property
    def master_id(self) -> NodeId | None: ...

    def send_command(self, command: Command) -> None: ...

    async def wait_for_state(self, predicate: Callable[[State], bool], timeout: float) -> bool: ...

    def open_stream(self, command_id: CommandId) -> ChunkStream:
        """Subscribe before the command is sent, so no chunk is missed. Close it when done."""
        ...

    def offer_payload(self, command_id: CommandId, params: TaskParams) -> None:
        """Keep the request's prompt on this node for the nodes that run it; withdrawn by close_stream."""
        ...

    def close_stream(self, stream: ChunkStream) -> None: ...
