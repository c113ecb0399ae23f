"""GET /metrics' runner series: each runner supervisor's state, queue, KV blocks and speculative drafts, read at
scrape time from what the supervisor already holds (its view's status and pending tasks, and the newest KV record
of its flight recorder), so serving does no work for them.

The runner records its engine's block pool (engines/torch/engine.py `kv_usage`: blocks in all, held, cached, the
engine's queue and its speculative totals) when a request's prefill starts (runner/core.py, the
`kv_cache_lookup` entry) and after a step that released requests (the `kv_released` entry, so the used blocks
fall back once traffic stops): these series are as of the runner's latest admission or release, and absent for a
runner whose engine has no paged pool or that has admitted nothing yet (a missing series rather than a misleading
zero).
Labels: model, instance_id and runner_id, as skulk_runner_restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from skulk.diagnostics.supervisor_view import SupervisorLike
from skulk.types.diagnostics import AttrValue, FlightRecorderEntry
from skulk.types.ids import RunnerId

LABELS = ["model", "instance_id", "runner_id"]
KV_EVENTS = frozenset({"prefix_hit", "prefix_miss", "kv_released"})
"""The flight recorder events that carry the engine's kv_usage (runner/core.py): a prefill's start, and a step
that released requests."""


def state_name(status: object) -> str:
    """RunnerReady -> Ready: the status kind the diagnostics show, without the common prefix."""
    return type(status).__name__.removeprefix("Runner")


def latest_kv(entries: Iterable[FlightRecorderEntry]) -> Mapping[str, AttrValue] | None:
    """The newest kv_usage record's attrs (the recorder's deque is bounded: an old one may have scrolled off)."""
    for entry in reversed(list(entries)):
        if entry.event in KV_EVENTS and "kv_blocks" in entry.attrs:
            return entry.attrs
    return None


def _number(attrs: Mapping[str, AttrValue], key: str) -> float | None:
    found = attrs.get(key)
    return float(found) if isinstance(found, int | float) and not isinstance(found, bool) else None


def runner_families(supervisors: Mapping[RunnerId, SupervisorLike]) -> Iterator[Metric]:
    """Every per-runner family, listed (HELP and TYPE) even when this node runs nothing."""
    restarts = CounterMetricFamily("skulk_runner_restarts", "Restarts of each runner on this node over its "
                                   "supervisor's life.", labels=LABELS)
    state = GaugeMetricFamily("skulk_runner_state", "1 for each runner on this node, labelled with its status "
                              "(Idle, Loading, WarmingUp, Ready, Running, Failed, ...).", labels=[*LABELS, "state"])
    pending = GaugeMetricFamily("skulk_runner_pending_tasks", "Tasks the supervisor holds that its runner has "
                                "not accepted yet.", labels=LABELS)
    kv = {key: GaugeMetricFamily(name, text, labels=LABELS) for key, name, text in KV_SERIES}
    spec = {key: CounterMetricFamily(name, text, labels=LABELS) for key, name, text in SPEC_SERIES}
    for supervisor in supervisors.values():
        context = supervisor.spec.context(None)
        labels = [context.model_id, context.instance_id, context.runner_id]
        view = supervisor.view
        restarts.add_metric(labels, supervisor.restart_count)
        state.add_metric([*labels, state_name(view.status)], 1.0)
        pending.add_metric(labels, len(view.pending))
        attrs = latest_kv(view.flight_recorder)
        if attrs is None:
            continue
        for key, family in kv.items():
            found = _kv_value(attrs, key)
            if found is not None:
                family.add_metric(labels, found)
        for key, family in spec.items():
            found = _number(attrs, key)
            if found is not None:
                family.add_metric(labels, found)
    yield from (restarts, state, pending, *kv.values(), *spec.values())


def _kv_value(attrs: Mapping[str, AttrValue], key: str) -> float | None:
    """A KV series' value; free is the pool less the blocks requests hold (cached prefixes are reclaimable)."""
    if key != "free":
        return _number(attrs, key)
    total, held = _number(attrs, "kv_blocks"), _number(attrs, "kv_blocks_held")
    return None if total is None or held is None else max(0.0, total - held)


KV_SERIES = (
    ("kv_blocks", "skulk_kv_blocks", "KV cache blocks in the runner's paged pool (as of its latest admission or "
     "release)."),
    ("kv_blocks_held", "skulk_kv_blocks_used", "KV blocks held by running requests (as of the latest admission or "
     "release)."),
    ("kv_blocks_cached", "skulk_kv_blocks_cached", "KV blocks keeping cached prefixes for reuse, reclaimable "
     "(as of the latest admission or release)."),
    ("free", "skulk_kv_blocks_free", "KV blocks no running request holds: the pool less the used blocks (as of "
     "the latest admission or release)."),
    ("kv_block_size", "skulk_kv_block_size_tokens", "Tokens per KV block."),
    ("queued", "skulk_engine_queued_requests", "Requests the engine holds waiting for batch rows or KV blocks (as "
     "of the latest admission or release)."),
    ("running", "skulk_engine_running_requests", "Requests in the engine's batch (as of the latest admission or "
     "release)."),
)
SPEC_SERIES = (
    ("spec_drafted", "skulk_speculative_drafted_tokens", "Speculative draft tokens proposed (prompt lookup or a "
     "draft model) by the requests the runner finished, as of its latest admission or release."),
    ("spec_accepted", "skulk_speculative_accepted_tokens", "Speculative draft tokens the model accepted, as of "
     "the runner's latest admission or release."),
)
