"""Questions about state that more than one layer asks (the master when it picks an instance, the worker when
it hands a task to its runners): answered once here."""

from __future__ import annotations

from skulk.types.instances import MlxRingInstance
from skulk.types.runners import RunnerReady, RunnerRunning
from skulk.types.state import State


def is_serving(state: State, instance: MlxRingInstance) -> bool:
    """Every rank of the instance is ready or running: only then can a task reach all of them."""
    return all(isinstance(state.runners.get(r), RunnerReady | RunnerRunning)
               for r in instance.shard_assignments.runner_to_shard)
