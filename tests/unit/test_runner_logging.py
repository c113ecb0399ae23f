"""The runner's warmup deadline: on overrun its log line says CRITICAL, as the runbook tells operators to grep."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

OVERRUN = """
import time
from types import SimpleNamespace
from skulk.runner import main
main.configure_logging()
runner = SimpleNamespace(spec=SimpleNamespace(runner_id="r-test", warmup_deadline_s=0.05))
main.Runner._warmup_with_deadline(runner, SimpleNamespace(warmup=lambda: time.sleep(30)))
"""


def test_warmup_overrun_line_is_critical_and_the_runner_exits() -> None:
    done = subprocess.run([sys.executable, "-c", OVERRUN], capture_output=True, text=True, timeout=50)
    assert done.returncode == 3, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "warmup" in ln]
    assert " CRITICAL " in line and "runner r-test" in line and "reboot" in line
