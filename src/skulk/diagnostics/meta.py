"""How a MetaInstance stands, in the words operators read in diagnostics, `skulk diag` and the dashboard
(seed 003): placing, healthy, retrying N/3, or an error with the last failure."""

from __future__ import annotations

from skulk.types.meta_instances import MAX_INSTANCE_RETRIES, MetaInstance
from skulk.types.runners import RunnerReady, RunnerRunning
from skulk.types.state import State


def meta_status(state: State, meta: MetaInstance) -> str:
    """Pure: `healthy`, `placing`, `RETRYING (n/3): <error>`, `error: <why it cannot be placed>`; a healthy
    instance re-created after a failure says so."""
    backing = [i for i in state.instances.values() if i.meta_instance_id == meta.meta_instance_id]
    serving = any(
        all(isinstance(state.runners.get(r), RunnerReady | RunnerRunning) for r in i.shard_assignments.runner_to_shard)
        for i in backing
    )
    if not backing:
        if meta.placement_error:
            return f"error: {meta.placement_error}"
        if meta.last_failure_error:
            return f"placing (retrying after error: {meta.last_failure_error})"
        return "placing"
    if meta.consecutive_failures and not serving:
        return f"RETRYING ({meta.consecutive_failures}/{MAX_INSTANCE_RETRIES}): {meta.last_failure_error}"
    if serving:
        return "healthy" if not meta.last_failure_error else "healthy (instance re-created due to failure)"
    return "starting"
