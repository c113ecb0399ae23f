"""The MetaInstance rules of apply() (seed 003). Pure; apply() dispatches here.

consecutive_failures and last_failure_error always change together; a new backing instance resets the counter
and the placement error but keeps last_failure_error, so an operator still sees why it was re-created.
"""

from __future__ import annotations

from typing import Any

from skulk.types.ids import InstanceId, MetaInstanceId
from skulk.types.instances import MlxRingInstance
from skulk.types.meta_instances import MetaInstance
from skulk.types.state import State


def _with_meta(state: State, meta: MetaInstance) -> dict[str, Any]:
    return {"meta_instances": {**state.meta_instances, meta.meta_instance_id: meta}}


def meta_created(state: State, meta: MetaInstance) -> dict[str, Any]:
    return _with_meta(state, meta)


def meta_deleted(state: State, meta_instance_id: MetaInstanceId) -> dict[str, Any]:
    if meta_instance_id not in state.meta_instances:
        return {}
    return {"meta_instances": {k: v for k, v in state.meta_instances.items() if k != meta_instance_id}}


def placement_failed(state: State, meta_instance_id: MetaInstanceId, reason: str) -> dict[str, Any]:
    meta = state.meta_instances.get(meta_instance_id)
    if meta is None:
        return {}
    return _with_meta(state, meta.model_copy(update={"placement_error": reason}))


def backing_created(state: State, instance: MlxRingInstance) -> dict[str, Any]:
    """A bound instance exists again: the placement succeeded, the failure streak is over."""
    meta = state.meta_instances.get(instance.meta_instance_id) if instance.meta_instance_id else None
    if meta is None:
        return {}
    return _with_meta(state, meta.model_copy(update={"placement_error": None, "consecutive_failures": 0}))


def backing_failed(state: State, instance_id: InstanceId, error: str | None) -> dict[str, Any]:
    """A bound instance failed (deleted with a failure, or retrying): count it. Call before the instance is
    removed from state, since the binding lives on the instance."""
    instance = state.instances.get(instance_id)
    if error is None or instance is None or instance.meta_instance_id is None:
        return {}
    meta = state.meta_instances.get(instance.meta_instance_id)
    if meta is None:
        return {}
    failures = meta.consecutive_failures + 1
    return _with_meta(state, meta.model_copy(update={"consecutive_failures": failures, "last_failure_error": error}))
