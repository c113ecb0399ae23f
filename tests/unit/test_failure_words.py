"""Failure words that say what happened (issue 38): a runner's death fails its open requests as retryable (they
say "retry the request"), a SIGKILL is called out of memory only when an OOM-kill counter went up, failure text
is cut on a word boundary with an ellipsis."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from skulk.api.errors import openai_error
from skulk.runner.messages import TaskEnded
from skulk.types.chunks import Chunk, ErrorChunk
from skulk.types.errors import ApiError, ErrorCode, clip_text
from skulk.types.runners import RunnerStatus
from skulk.worker import oom
from skulk.worker.supervisor import RunnerSupervisor, SupervisorCallbacks, exit_cause

from .diagnostics_fakes import spec_for
from .factories import chat_task, instance

pytestmark = pytest.mark.timeout(30)


def test_a_runners_death_fails_its_requests_as_retryable() -> None:
    chunks: list[Chunk] = []
    ended: list[TaskEnded] = []
    statuses: list[RunnerStatus] = []
    callbacks = SupervisorCallbacks(on_status=statuses.append, on_chunks=chunks.extend,
                                    on_task_started=lambda _: None, on_task_ended=ended.append)
    supervisor = RunnerSupervisor(spec_for(instance(), "n1"), callbacks)
    task = chat_task()
    supervisor.view.pending[task.task_id] = task
    supervisor._fail_open_tasks("runner hung: no message for 15 s (group timeout), killed")
    (chunk,) = chunks
    assert isinstance(chunk, ErrorChunk) and chunk.retryable and chunk.code == ErrorCode.task_failed
    assert chunk.message.endswith("retry the request")
    assert [e.retryable for e in ended] == [True]
    body = json.loads(bytes(openai_error(ApiError(chunk.code, chunk.message, status=chunk.status,
                                            retryable=chunk.retryable)).body))
    assert body["error"]["retryable"] is True and body["error"]["code"] == "task_failed"
    refusal = json.loads(bytes(openai_error(ApiError(ErrorCode.invalid_request, "no")).body))
    assert "retryable" not in refusal["error"]


def test_sigkill_is_oom_only_with_evidence() -> None:
    assert exit_cause(-signal.SIGKILL, oom=True).startswith("OOM")
    outside = exit_cause(-signal.SIGKILL, oom=False)
    assert outside == "killed by signal 9 (SIGKILL) from outside (no OOM kill was recorded while it ran)"
    assert "out of memory" in exit_cause(-signal.SIGKILL) and not exit_cause(-signal.SIGKILL).startswith("OOM")
    assert oom.oom_evidence(3, 4) is True and oom.oom_evidence(3, 3) is False and oom.oom_evidence(None, 4) is None


def test_oom_counters_are_read_from_the_cgroup_then_the_host(tmp_path: Path) -> None:
    assert oom.counter("low 0\nhigh 2\noom 1\noom_kill 7\n") == 7 and oom.counter("oom 1\n") is None
    v2 = oom.counter_files("0::/user.slice/skulk.service\n", tmp_path)
    assert v2[0] == tmp_path / "user.slice/skulk.service/memory.events" and v2[-1] == Path("/proc/vmstat")
    v1 = oom.counter_files("4:memory:/docker/abc\n1:cpu:/\n0::/\n", tmp_path)
    assert v1[0] == tmp_path / "memory/docker/abc/memory.oom_control"
    before = oom.oom_kills()
    assert before is None or oom.oom_evidence(before, oom.oom_kills()) is False, "nothing was OOM-killed here"


def test_a_manual_kill_9_of_a_process_reads_as_from_outside() -> None:
    """A real child killed with SIGKILL: the counter did not move, so the words say so."""
    import subprocess
    import sys

    before = oom.oom_kills()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    child.send_signal(signal.SIGKILL)
    code = child.wait(10)
    words = exit_cause(code, oom=oom.oom_evidence(before, oom.oom_kills()))
    assert words.startswith("killed by signal 9 (SIGKILL)") and "likely OOM" not in words


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("short", 20, "short"),
    ("the runner crashed while loading weights", 20, "the runner crashed…"),
    ("RuntimeError: connection closed by peer", 27, "RuntimeError: connection…"),
    ("x" * 30, 10, "x" * 9 + "…"),
])
def test_failure_text_is_cut_on_a_word_boundary(text: str, limit: int, expected: str) -> None:
    clipped = clip_text(text, limit)
    assert clipped == expected and len(clipped) <= limit
