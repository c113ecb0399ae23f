"""Identifiers. Plain strings on the wire; distinct names in code so signatures say what they take."""

from __future__ import annotations

import uuid
from typing import NewType

NodeId = NewType("NodeId", str)
InstanceId = NewType("InstanceId", str)
RunnerId = NewType("RunnerId", str)
TaskId = NewType("TaskId", str)
CommandId = NewType("CommandId", str)
ModelId = NewType("ModelId", str)
MetaInstanceId = NewType("MetaInstanceId", str)


def new_id() -> str:
    return str(uuid.uuid4())
