"""Secrets masked by shape and by value (issue 27), and the desired state a full restart brings back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

from _pytest.logging import LogCaptureFixture

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


def _write(home: Path, body: object) -> None:
    (home / "desired.json").write_text(body if isinstance(body, str) else json.dumps(body))


def test_one_bad_entry_is_skipped_named_and_the_rest_restored(tmp_path: Path, caplog: LogCaptureFixture) -> None:
    good = meta("good").model_dump(mode="json", by_alias=True)
    bad = {**meta("bad").model_dump(mode="json", by_alias=True), "minNodes": 1000000}
    _write(tmp_path, {"formatVersion": 2, "metaInstances": {"good": good, "bad": bad},
                      "modelCards": {"x/y": {"nope": 1}}, "tracingEnabled": True})
    original = (tmp_path / "desired.json").read_bytes()
    with caplog.at_level(logging.ERROR, logger="skulk.state.desired"):
        keeper = DesiredStateFile(tmp_path)
    assert keeper.saved is not None and list(keeper.saved.meta_instances) == ["good"]
    assert keeper.saved.tracing_enabled is True and keeper.saved.model_cards == {}
    named = {s.entry: s for s in keeper.skipped}
    assert set(named) == {"metaInstances.bad", "modelCards.x/y"} and "minNodes" in named["metaInstances.bad"].reason
    assert "metaInstances.bad" in caplog.text and "minNodes" in caplog.text
    (aside,) = tmp_path.glob("desired.json.corrupt-*")
    assert aside.read_bytes() == original and named["metaInstances.bad"].kept_at == str(aside)


def test_an_unreadable_file_is_kept_aside_before_anything_is_written(tmp_path: Path) -> None:
    for garbage in ("\x00\xff garbage {", "[1, 2]"):
        for old in tmp_path.glob("desired.json*"):
            old.unlink()
        _write(tmp_path, garbage)
        keeper = DesiredStateFile(tmp_path)
        assert keeper.saved is None and [s.entry for s in keeper.skipped] == ["file"]
        (aside,) = tmp_path.glob("desired.json.corrupt-*")
        assert aside.read_text() == garbage
        keeper._pending = State(master_node_id=NodeId("m"), meta_instances={MetaInstanceId("a"): meta("a")})
        keeper.flush()  # now, not after the delay
        assert aside.read_text() == garbage and DesiredStateFile(tmp_path).skipped == []


def test_the_skipped_entries_reach_the_diagnostics_bundle(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from skulk.api.app import create_app

    from .factories import api_services

    _write(tmp_path, {"metaInstances": {"bad": {"minNodes": 0}}})
    keeper = DesiredStateFile(tmp_path)
    services = dataclasses.replace(api_services(), desired_skipped=lambda: keeper.skipped)
    bundle = TestClient(create_app(services), base_url="http://127.0.0.1").get("/v1/diagnostics/node").json()
    (skipped,) = bundle["desiredStateSkipped"]
    assert skipped["entry"] == "metaInstances.bad" and skipped["keptAt"].startswith(str(tmp_path))
