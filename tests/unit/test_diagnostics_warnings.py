"""One test per heuristic warning, each with the case that must stay quiet."""

from __future__ import annotations

from skulk.diagnostics.warnings import (
    Thresholds,
    all_warnings,
    master_outside_placement,
    phase_stuck,
    process_mismatch,
    rank_disagreement,
    task_mismatch,
    version_mismatch,
)
from skulk.types.ids import NodeId, RunnerId, TaskId
from skulk.types.node_info import NodeIdentity
from skulk.types.runners import RunnerReady, RunnerShutdown
from skulk.types.tasks import TaskStatus

from .diagnostics_fakes import NOW, ago, cluster_state, timeline_runner

TH = Thresholds(barrier_wait_s=5.0, phase_stuck_s=60.0, task_grace_s=5.0)


def test_rank_disagreement_flags_the_rank_waiting_at_a_barrier() -> None:
    runners = [
        timeline_runner("n1", 0, "decode_stream", 30.0),
        timeline_runner("n2", 1, "decode_barrier", 12.0),
    ]
    (warning,) = rank_disagreement(cluster_state(), runners, NOW, TH)
    assert warning.code == "rank_disagreement" and warning.severity == "critical"
    assert warning.runner_id == "r-n2" and warning.instance_id == "inst" and warning.node_id == "n2"
    assert "rank 1: decode_barrier" in warning.message


def test_rank_disagreement_names_the_lowest_waiting_rank_whatever_order_runners_come_in() -> None:
    """Two ranks each waiting at a different barrier (a wedged pipeline: rank 0 for the first token, rank 1 at
    task agreement) give one warning about rank 0, however the timeline happened to list them."""
    runners = [
        timeline_runner("n2", 1, "task_agreement", 6.0),
        timeline_runner("n1", 0, "decode_wait_first_token", 8.0),
    ]
    (warning,) = rank_disagreement(cluster_state(), runners, NOW, TH)
    assert warning.runner_id == "r-n1" and "rank 0 waits at decode_wait_first_token" in warning.message
    (again,) = rank_disagreement(cluster_state(), runners[::-1], NOW, TH)
    assert again == warning


def test_rank_disagreement_names_rank_0_even_before_its_own_wait_crossed_the_threshold() -> None:
    """A wedged rank 1 takes its header while rank 0 still prefills, so rank 1 crosses the threshold first; the
    warning still names rank 0 (it failed once in CI naming rank 1, after headers became point to point)."""
    runners = [
        timeline_runner("n2", 1, "task_agreement", 5.4),
        timeline_runner("n1", 0, "decode_wait_first_token", 4.9),
    ]
    (warning,) = rank_disagreement(cluster_state(), runners, NOW, TH)
    assert warning.runner_id == "r-n1" and "rank 0 waits at decode_wait_first_token" in warning.message


def test_rank_disagreement_counts_a_silent_stream_as_waiting() -> None:
    """Rank 0 of a pipelined Pipeline waits for the sampler's tokens inside decode_stream: silent past the barrier
    wait, it is the rank named, not the wedged rank 1 at task agreement."""
    runners = [
        timeline_runner("n2", 1, "task_agreement", 6.0),
        timeline_runner("n1", 0, "decode_stream", 9.0, last_progress_at=ago(6)),
    ]
    (warning,) = rank_disagreement(cluster_state(), runners, NOW, TH)
    assert warning.runner_id == "r-n1" and "rank 0 waits at decode_stream" in warning.message
    runners[1] = timeline_runner("n1", 0, "decode_stream", 9.0, last_progress_at=ago(1))  # streaming: not waiting
    (warning,) = rank_disagreement(cluster_state(), runners, NOW, TH)
    assert warning.runner_id == "r-n2"


def test_rank_disagreement_is_quiet_for_short_waits_and_agreeing_ranks() -> None:
    short = [timeline_runner("n1", 0, "decode_stream", 1.0), timeline_runner("n2", 1, "decode_barrier", 1.0)]
    agree = [timeline_runner("n1", 0, "decode_barrier", 50.0), timeline_runner("n2", 1, "decode_barrier", 50)]
    assert rank_disagreement(cluster_state(), short, NOW, TH) == []
    assert rank_disagreement(cluster_state(), agree, NOW, TH) == []


def test_phase_stuck_with_an_active_task() -> None:
    runners = [
        timeline_runner("n1", 0, "prompt_build", 90.0),
        timeline_runner("n2", 1, "prompt_build", 90.0, active_task_id=None),
    ]
    (warning,) = phase_stuck(cluster_state(), runners, NOW, TH)
    assert warning.code == "phase_stuck" and warning.runner_id == "r-n1"


def test_phase_stuck_judges_streams_by_last_progress() -> None:
    progressing = timeline_runner("n1", 0, "decode_stream", 300.0, last_progress_at=ago(1))
    silent = timeline_runner("n2", 1, "decode_stream", 300.0, last_progress_at=ago(120))
    found = phase_stuck(cluster_state(), [progressing, silent], NOW, TH)
    assert [w.runner_id for w in found] == ["r-n2"]


def test_master_outside_placement() -> None:
    assert master_outside_placement(cluster_state(master="n1"), [], NOW, TH) == []
    (warning,) = master_outside_placement(cluster_state(master="n9"), [], NOW, TH)
    assert warning.code == "master_outside_placement" and warning.instance_id == "inst"
    assert warning.node_id == "n9"


def test_runner_reports_a_task_unknown_to_state() -> None:
    runners = [timeline_runner("n1", 0, "prefill_pipeline", 10.0, active_task_id="ghost")]
    (warning,) = task_mismatch(cluster_state(), runners, NOW, TH)
    assert warning.code == "runner_task_unknown" and warning.runner_id == "r-n1"


def test_runner_reports_a_task_state_says_is_finished() -> None:
    state = cluster_state()
    done = state.tasks[TaskId("t1")].model_copy(update={"task_status": TaskStatus.Complete})
    state = state.model_copy(update={"tasks": {TaskId("t1"): done}})
    runners = [timeline_runner("n1", 0, "decode_stream", 10.0)]
    (warning,) = task_mismatch(state, runners, NOW, TH)
    assert warning.code == "runner_task_finished" and "Complete" in warning.message
    fresh = [timeline_runner("n1", 0, "decode_stream", 1.0)]
    assert task_mismatch(state, fresh, NOW, TH) == []
    assert task_mismatch(cluster_state(), runners, NOW, TH) == []


def test_live_process_while_state_says_the_runner_is_gone() -> None:
    state = cluster_state()
    gone = state.model_copy(update={"runners": {RunnerId("r-n2"): RunnerReady()}})
    (warning,) = process_mismatch(gone, [timeline_runner("n1", 0, "idle", 1.0)], NOW, TH)
    assert warning.code == "runner_process_orphaned"
    shut = state.model_copy(update={"runners": {RunnerId("r-n1"): RunnerShutdown()}})
    assert process_mismatch(shut, [timeline_runner("n1", 0, "idle", 1.0)], NOW, TH)[0].code == (
        "runner_process_orphaned"
    )


def test_dead_process_while_state_says_the_runner_is_live() -> None:
    dead = [timeline_runner("n1", 0, "idle", 1.0, process_alive=False)]
    (warning,) = process_mismatch(cluster_state(), dead, NOW, TH)
    assert warning.code == "runner_process_dead" and "RunnerRunning" in warning.message
    assert process_mismatch(cluster_state(), [timeline_runner("n1", 0, "idle", 1.0)], NOW, TH) == []


def test_nodes_running_different_versions() -> None:
    state = cluster_state()
    assert version_mismatch(state, [], NOW, TH) == []
    idents = {**state.node_identities, NodeId("n2"): NodeIdentity(skulk_version="0.2.0")}
    (warning,) = version_mismatch(state.model_copy(update={"node_identities": idents}), [], NOW, TH)
    assert warning.code == "version_mismatch" and "0.2.0" in warning.message


def test_all_warnings_is_quiet_on_a_healthy_cluster() -> None:
    runners = [timeline_runner("n1", 0, "decode_stream", 2.0), timeline_runner("n2", 1, "decode_stream", 2.0)]
    assert all_warnings(cluster_state(), runners, NOW, TH) == []
