"""JSON log lines: one object per record, with the ids bound in context or passed as extra."""

from __future__ import annotations

import asyncio
import json
import logging

from skulk.structured_log import JsonLines, log_context


def record(message: str, **extra: str) -> logging.LogRecord:
    made = logging.LogRecord("skulk.test", logging.WARNING, __file__, 1, message, None, None)
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def test_line_carries_ids_from_context_and_extra() -> None:
    formatter = JsonLines("node-1")
    with log_context(command_id="cmd-1", instance_id="inst-1"):
        line = json.loads(formatter.format(record("hello", runner_id="run-1")))
    assert line["level"] == "WARNING" and line["logger"] == "skulk.test" and line["nodeId"] == "node-1"
    assert (line["message"], line["commandId"], line["instanceId"], line["runnerId"]) == (
        "hello", "cmd-1", "inst-1", "run-1")
    assert "taskId" not in line and "time" in line
    assert "commandId" not in json.loads(formatter.format(record("after"))), "the binding ends with the block"


def test_concurrent_tasks_never_see_each_others_ids() -> None:
    formatter = JsonLines("n")

    async def one(task_id: str) -> str:
        with log_context(task_id=task_id):
            await asyncio.sleep(0.01)
            return json.loads(formatter.format(record("x")))["taskId"]

    async def both() -> list[str]:
        return list(await asyncio.gather(one("a"), one("b")))

    assert asyncio.run(both()) == ["a", "b"]
