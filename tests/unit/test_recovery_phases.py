"""The recovery benches' phase split (testing/phases.py) and their CPU load generator (testing/load.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import pytest

from skulk.testing.load import cpu_load
from skulk.testing.phases import durations, master_events, split

T0 = 1_000.0
OLD, NEW, META = "old-instance", "new-instance", "meta-1"


def record(at: float, idx: int, kind: str, fields: dict[str, Any], term: int = 1, master: str = "m1") -> dict[str, Any]:
    return {"seq": idx, "at": at, "kind": kind, "event": {"idx": idx, "term": term, "master": master,
                                                           "event": {kind: fields}}}


def created(at: float, idx: int, instance: str, runners: list[str], meta: str | None = META) -> dict[str, Any]:
    body = {"instanceId": instance, "metaInstanceId": meta,
            "shardAssignments": {"runnerToShard": {r: {} for r in runners}}}
    return record(at, idx, "InstanceCreated", {"instance": {"MlxRingInstance": body}})


def status(at: float, idx: int, runner: str, kind: str) -> dict[str, Any]:
    return record(at, idx, "RunnerStatusUpdated", {"runnerId": runner, "runnerStatus": {kind: {}}})


def worker_loss() -> list[dict[str, Any]]:
    return [
        created(T0 - 30, 1, OLD, ["r0", "r1"]),  # before the fault: never a phase
        record(T0 + 0.4, 2, "NodeTimedOut", {"nodeId": "victim"}),
        record(T0 + 0.4, 3, "InstanceDeleted", {"instanceId": OLD}),
        created(T0 + 1.3, 4, NEW, ["r2", "r3"]),
        status(T0 + 5.0, 5, "r2", "RunnerReady"),
        status(T0 + 6.0, 6, "r3", "RunnerLoading"),
        status(T0 + 9.2, 7, "r3", "RunnerReady"),
    ]


def test_a_worker_loss_splits_into_detect_place_load_without_an_election() -> None:
    marks = split(worker_loss(), T0, victim="victim", meta_id=META, old=[OLD])
    assert marks == pytest.approx({"detect": 0.4, "place": 1.3, "load": 9.2})
    assert durations(marks) == pytest.approx({"detect": 0.4, "place": 0.9, "load": 7.9})


def test_load_ends_when_the_last_runner_is_ready_not_the_first() -> None:
    marks = split(worker_loss()[:-1], T0, victim="victim", meta_id=META, old=[OLD])
    assert "load" not in marks


def test_a_master_loss_is_detected_when_the_new_session_starts() -> None:
    records = [record(T0 + 1.3, 10, "SessionStarted", {"masterNodeId": "m2", "term": 2}, term=2, master="m2"),
               created(T0 + 1.3, 11, NEW, ["r2"])]
    marks = split(records, T0, victim="m1", meta_id=META, old=[OLD])
    assert marks == pytest.approx({"detect": 1.3, "elect": 1.3, "place": 1.3})


def test_another_meta_instances_placement_is_not_the_replacement() -> None:
    records = [created(T0 + 1.0, 1, "other", ["x"], meta="meta-2"), created(T0 + 2.0, 2, NEW, ["r2"])]
    assert split(records, T0, meta_id=META, old=[OLD])["place"] == pytest.approx(2.0)


def test_an_event_applied_by_several_nodes_counts_at_its_earliest() -> None:
    seen_late = record(T0 + 2.0, 2, "NodeTimedOut", {"nodeId": "victim"})
    seen_early = record(T0 + 0.5, 2, "NodeTimedOut", {"nodeId": "victim"})
    request_tap = {"seq": 9, "at": T0 + 0.1, "kind": "ChatRequest", "event": {"command": "x"}}
    assert [e[0] for e in master_events([seen_late, seen_early, request_tap])] == [T0 + 0.5]
    assert split([seen_late, seen_early], T0, victim="victim")["detect"] == pytest.approx(0.5)


def test_a_full_restart_has_no_detect_phase() -> None:
    records = [record(T0 + 3.0, 0, "SessionStarted", {"masterNodeId": "m2", "term": 1})]
    assert split(records, T0, detect=False) == pytest.approx({"elect": 3.0})


def test_the_load_generator_keeps_its_spinners_busy_and_reaps_them() -> None:
    with cpu_load(2) as pids:
        assert len(pids) == 2
        spinners = [psutil.Process(p) for p in pids]
        for spinner in spinners:
            spinner.cpu_percent(None)
        time.sleep(0.5)
        assert all(s.nice() == os.nice(0) for s in spinners)
        assert sum(s.cpu_percent(None) for s in spinners) > 20  # spinning, even on a shared machine
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_no_load_starts_nothing() -> None:
    with cpu_load(0) as pids:
        assert pids == []
