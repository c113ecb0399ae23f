"""How a MetaInstance stands, in the words operators read in diagnostics, `skulk diag` and the dashboard
(seed 003): placing, healthy, retrying N/3, or an error with the last failure."""

from __future__ import annotations

from skulk.types.meta_instances import MAX_INSTANCE_RETRIES, MetaInstance
from skulk.types.runners import RunnerReady, RunnerRunning
from skulk.types.state import State


def meta_status(state: State, meta: MetaInstance) -> str:
    """Pure: `healthy`, `placing`, `RETRYING (n/3): <error>`, `error: <why it cannot be placed>`; a healthy
    instance re-created after a failure says so, and one that recovered from an in-place retry says that."""
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
        return _healthy(meta)
    return "starting"


def _healthy(meta: MetaInstance) -> str:
    """Only a new backing instance resets consecutive_failures (keeping the error), so a failure on record
    with the counter at 0 means the instance was re-created; a counter above 0 means the same instance came
    back from an in-place retry, which is not a re-creation (seed 003: the dashboard drops the n/3 prefix
    exactly when consecutiveFailures is 0)."""
    if not meta.last_failure_error:
        return "healthy"
    if meta.consecutive_failures == 0:
        return "healthy (instance re-created due to failure)"
    return (f"healthy (recovered in place after retry {meta.consecutive_failures}/{MAX_INSTANCE_RETRIES}: "
            f"{meta.last_failure_error})")
