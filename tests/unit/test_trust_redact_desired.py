"""Secrets masked by shape and by value (issue 27), and the desired state a full restart brings back."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from skulk import redact
from skulk.state.desired import DesiredStateFile, desired_of, restore_events
from skulk.types.events import MetaInstanceCreated, ModelCardAdded, TracingStateChanged
from skulk.types.ids import MetaInstanceId, ModelId, NodeId
from skulk.types.meta_instances import MetaInstance
from skulk.types.state import State


def test_command_lines_hide_every_secret_flag_and_assignment() -> None:
    argv = ["python", "-m", "skulk", "--cluster-key", "K1", "--api-key=K2", "--admin-key", "K3", "--hf-token",
            "K4", "SKULK_API_KEYS=K5", "--api-port", "52415", "--home", "/h"]
    out = redact.command_line(argv)
    assert not {"K1", "K2", "K3", "K4", "K5"} & set(" ".join(out).replace("=", " ").split())
    assert out[-4:] == ["--api-port", "52415", "--home", "/h"]


def test_registered_secrets_are_scrubbed_from_text_and_log_records() -> None:
    redact.register(["s3cr3t-value", None, "ab"])
    assert redact.scrub("token s3cr3t-value in a url") == "token *** in a url"
    assert redact.scrub("ab stays: too short to scrub by value") == "ab stays: too short to scrub by value"
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key was %s", ("s3cr3t-value",), None)
    assert redact.ScrubFilter().filter(record) and record.getMessage() == "key was ***"
    try:
        raise ValueError("bad key s3cr3t-value")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    redact.ScrubFilter().filter(record)
    assert "s3cr3t-value" not in logging.Formatter().format(record) and "***" in record.getMessage()


def meta(mid: str, **extra: object) -> MetaInstance:
    return MetaInstance(meta_instance_id=MetaInstanceId(mid), model_id=ModelId("m/x"), **extra)  # pyright: ignore


def test_desired_state_drops_what_is_measured_and_restores_only_what_is_missing() -> None:
    state = State(meta_instances={MetaInstanceId("a"): meta("a", consecutive_failures=2, placement_error="full",
                                                            node_ids=[NodeId("old")])},
                  tracing_enabled=True, master_node_id=NodeId("m"))
    desired = desired_of(state)
    assert desired.meta_instances[MetaInstanceId("a")].consecutive_failures == 0
    assert desired.meta_instances[MetaInstanceId("a")].placement_error is None
    events = restore_events(State(), desired)
    assert [type(e) for e in events] == [MetaInstanceCreated, TracingStateChanged]
    created = events[0]
    assert isinstance(created, MetaInstanceCreated) and created.meta_instance.node_ids is None, "pins name old ids"
    assert restore_events(state, desired) == [], "nothing the state already has"
    assert not [e for e in restore_events(State(), desired) if isinstance(e, ModelCardAdded)]


async def test_the_file_is_written_once_per_burst_and_read_back_at_start(tmp_path: Path) -> None:
    keeper = DesiredStateFile(tmp_path)
    assert keeper.saved is None
    empty = State(master_node_id=NodeId("m"))
    keeper.observe(empty)  # a restarted cluster's empty first session...
    keeper.observe(empty.model_copy(update={"meta_instances": {MetaInstanceId("a"): meta("a")}}))  # ...then restore
    await asyncio.sleep(0.7)
    assert DesiredStateFile(tmp_path).saved == desired_of(
        State(meta_instances={MetaInstanceId("a"): meta("a")}))
    keeper.observe(State())  # no master: never saved over a good file
    keeper.flush()
    assert MetaInstanceId("a") in (DesiredStateFile(tmp_path).saved or desired_of(State())).meta_instances
