"""Format versions (types/versions.py): the decision, the zenoh gate on real sessions, the HTTP check, and the
start-up migration of desired.json and the event log."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from pytest import LogCaptureFixture

from skulk import file_format, internal_auth
from skulk.api.security import version_refused
from skulk.cluster.transport import Transport, TransportSettings
from skulk.eventlog import EventLog, Limits
from skulk.eventlog import log as eventlog_module
from skulk.file_format import migrated
from skulk.models import cards
from skulk.state.desired import DesiredStateFile
from skulk.testing.nodes import free_port
from skulk.tracing.store import TraceStore
from skulk.types import versions
from skulk.types.ids import ModelId, NodeId
from skulk.types.state import State
from skulk.types.versions import Compat, FileAction

pytestmark = pytest.mark.timeout(30)


def test_same_and_one_apart_are_worked_with_the_rest_refused() -> None:
    assert versions.judge(2, 2) is Compat.same
    assert versions.judge(1, 2) is Compat.compatible and versions.judge(3, 2) is Compat.compatible
    assert versions.judge(4, 2) is Compat.peer_newer and versions.judge(0, 2) is Compat.peer_older
    assert versions.judge(None, 2) is Compat.unreadable
    assert [versions.accepted(versions.judge(v, 2)) for v in (0, 1, 2, 3, 4)] == [False, True, True, True, False]


def test_the_refusal_line_names_both_versions_and_what_to_upgrade() -> None:
    ahead = versions.refusal_line("node x", 4, 2)
    assert "format version 4" in ahead and "speaks 2" in ahead and "upgrade this node" in ahead
    behind = versions.refusal_line("node x", 1, 3)
    assert "format version 1" in behind and "speaks 3" in behind and "upgrade node x" in behind
    assert "not a Skulk node" in versions.refusal_line("node x", None, 2)


def test_what_carries_no_version_is_version_one() -> None:
    assert versions.version_of_attachment(None) == versions.UNVERSIONED == 1
    assert versions.version_of_attachment(versions.attachment(7)) == 7
    assert versions.version_of_attachment(b"something-else") is None
    assert versions.version_of_attachment(versions.ATTACHMENT_PREFIX + b"x") is None
    assert versions.version_of_header(None) == 1 and versions.version_of_header("3") == 3
    assert versions.version_of_header("-1") is None
    assert versions.file_version({"a": 1}) == 1 and versions.file_version({"formatVersion": 2}) == 2
    assert versions.file_version({"formatVersion": True}) is None


def test_files_older_are_migrated_newer_refused() -> None:
    assert versions.file_action(1, 2) is FileAction.migrate
    assert versions.file_action(2, 2) is FileAction.current
    assert versions.file_action(3, 2) is FileAction.refuse and versions.file_action(None, 2) is FileAction.refuse
    assert migrated({"savedAt": "t"}, 1) == {"savedAt": "t", "formatVersion": versions.FORMAT_VERSION}


def test_a_node_to_node_call_two_versions_ahead_is_refused_with_one_log_line(caplog: LogCaptureFixture) -> None:
    header = versions.HEADER.encode()
    assert version_refused({}) is None, "a client that is not a node says no version"
    assert version_refused({header: str(versions.FORMAT_VERSION + 1).encode()}) is None
    ahead = str(versions.FORMAT_VERSION + 2).encode()
    with caplog.at_level(logging.WARNING, logger="skulk.internal_auth"):
        first = version_refused({header: ahead})
        second = version_refused({header: ahead})
    assert first is not None and first == second and "upgrade this node" in first
    assert caplog.text.count("refusing a peer's call") == 1
    assert internal_auth.signed_headers("GET", "/x", "store")[versions.HEADER] == str(versions.FORMAT_VERSION)


# -- the zenoh gate, on real sessions ------------------------------------------------------------------------


@pytest.fixture
async def mesh() -> AsyncIterator[list[Transport]]:
    """Four sessions of one cluster: the first at this release, then peers speaking versions 3, 4 and 1."""
    cluster, port = f"v{uuid.uuid4().hex[:8]}", free_port()
    first = f"tcp/127.0.0.1:{port}"
    made = [Transport(TransportSettings(cluster=cluster, listen=[first], multicast=False))]
    for version in (3, 4, 1):
        made.append(Transport(TransportSettings(cluster=cluster, listen=["tcp/127.0.0.1:0"], multicast=False,
                                                bootstrap_peers=[first], format_version=version)))
    for t in made:
        t.open()
    try:
        yield made
    finally:
        for t in made:
            t.close()


async def _until(condition: Callable[[], bool], put: Callable[[], None], timeout: float = 10.0) -> None:
    """Re-put every 50 ms until `condition()` (subscriptions take a moment to reach a new peer)."""
    async def loop() -> None:
        while not condition():
            put()
            await asyncio.sleep(0.05)
    await asyncio.wait_for(loop(), timeout)


async def test_a_peer_one_version_apart_is_heard_two_apart_dropped_with_one_line(
        mesh: list[Transport], caplog: LogCaptureFixture) -> None:
    ours, plus_one, plus_two, unversioned = mesh
    heard: list[bytes] = []
    ours.subscribe("topic", lambda _key, payload: heard.append(payload))
    with caplog.at_level(logging.WARNING, logger="skulk.cluster.transport"):
        await _until(lambda: b"v3" in heard, lambda: plus_one.put("topic", b"v3"))
        # the release before versioning sends no attachment at all
        await _until(lambda: b"v1" in heard, lambda: unversioned.session.put(unversioned.key("topic"), b"v1"))
        await _until(lambda: ours.versions.refused.get("4", 0) >= 3, lambda: plus_two.put("topic", b"v4"))
    assert b"v4" not in heard
    assert ours.versions.met == {1, 3}, "both neighbours were worked with"
    lines = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "format version 4" in lines[0] and f"speaks {versions.FORMAT_VERSION}" in lines[0]
    assert "upgrade this node" in lines[0]


async def test_queries_are_answered_only_within_one_version(mesh: list[Transport]) -> None:
    ours, plus_one, plus_two, _ = mesh
    ours.serve("ask", lambda _key, _params: b"answer")
    replies: list[bytes] = []

    async def ask() -> None:
        while not replies:
            replies.extend(await plus_one.query("ask", timeout_s=0.5))
    await asyncio.wait_for(ask(), 10)
    assert replies == [b"answer"]
    assert await plus_two.query("ask", timeout_s=0.5) == [], "a query two versions ahead is not answered"
    assert ours.versions.refused.get("4", 0) >= 1


# -- persisted files ------------------------------------------------------------------------------------------

META = {"metaInstanceId": "m1", "modelId": "skulk/tiny-random-llama"}


def test_a_version_one_desired_file_is_migrated_with_a_backup(tmp_path: Path) -> None:
    original = json.dumps({"savedAt": "2026-01-01T00:00:00+00:00", "metaInstances": {"m1": META}})
    (tmp_path / "desired.json").write_text(original)
    keeper = DesiredStateFile(tmp_path)
    assert keeper.saved is not None and list(keeper.saved.meta_instances) == ["m1"] and not keeper.skipped
    assert (tmp_path / "desired.json.v1.bak").read_text() == original
    now = json.loads((tmp_path / "desired.json").read_text())
    assert now["formatVersion"] == versions.FORMAT_VERSION and now["metaInstances"] == {"m1": META}
    again = DesiredStateFile(tmp_path)
    assert again.saved == keeper.saved and (tmp_path / "desired.json.v1.bak").read_text() == original


def test_a_desired_file_of_a_newer_format_is_refused_and_never_written(tmp_path: Path,
                                                                       caplog: LogCaptureFixture) -> None:
    original = json.dumps({"formatVersion": versions.FORMAT_VERSION + 1, "metaInstances": {"m1": META}})
    (tmp_path / "desired.json").write_text(original)
    with caplog.at_level(logging.ERROR, logger="skulk.state.desired"):
        keeper = DesiredStateFile(tmp_path)
    assert keeper.saved is None and keeper.refused is not None and "upgrade this node" in keeper.refused
    assert f"format version {versions.FORMAT_VERSION + 1}" in caplog.text
    keeper._pending = State(master_node_id=NodeId("m"))
    keeper.flush()
    assert (tmp_path / "desired.json").read_text() == original
    assert not list(tmp_path.glob("desired.json.v*.bak"))


def _v1_records(count: int) -> bytes:
    return b"".join(b'{"seq":%d,"at":1.0,"kind":"TokenChunk","event":{"n":%d}}\n' % (i, i)
                    for i in range(1, count + 1))


def _open(directory: Path) -> EventLog:
    log = EventLog(directory, Limits(), probe=lambda _p: 1 << 50, flush_every_s=0.005)
    log.open()
    return log


def test_a_version_one_event_log_is_migrated_with_a_backup(tmp_path: Path) -> None:
    original = _v1_records(3) + b'{"seq":4,"at":1.0,"ki'  # and a torn last record
    (tmp_path / "events.jsonl").write_bytes(original)
    log = _open(tmp_path)
    try:
        log.append({"n": 5})
        assert log.flush()
        found = log.read(0, 10)
    finally:
        log.close()
    assert (tmp_path / "events.jsonl.v1.bak").read_bytes() == original
    assert [r["seq"] for r in found] == [1, 2, 3, 4], "the torn record dropped, numbering goes on"
    assert all(r["v"] == versions.FORMAT_VERSION for r in found)
    assert found[0]["event"] == {"n": 1} and found[-1]["event"] == {"n": 5}


def test_an_event_log_of_a_newer_format_is_left_untouched(tmp_path: Path) -> None:
    original = b'{"seq":1,"v":%d,"at":1.0,"kind":"X","event":{}}\n' % (versions.FORMAT_VERSION + 1)
    (tmp_path / "events.jsonl").write_bytes(original)
    log = _open(tmp_path)
    try:
        log.append({"n": 2})
        assert log.flush()
        assert log.counting_only and log.refused is not None and "upgrade this node" in log.refused
        assert log.status()["countingOnlyReason"] == log.refused
    finally:
        log.close()
    assert (tmp_path / "events.jsonl").read_bytes() == original


def test_custom_cards_are_written_versioned_a_version_one_card_migrated_a_newer_one_skipped(tmp_path: Path) -> None:
    base = cards.all_cards()[0]
    ours = base.model_copy(update={"model_id": ModelId("test/versioned")})
    old = base.model_copy(update={"model_id": ModelId("test/version-one")})
    newer = base.model_copy(update={"model_id": ModelId("test/from-the-future")})
    try:
        cards.add_custom_card(tmp_path, ours)
        written = json.loads((tmp_path / "test--versioned.json").read_text())
        assert written["formatVersion"] == versions.FORMAT_VERSION
        (tmp_path / "old.json").write_text(old.model_dump_json())  # as the previous release wrote cards
        future = {**newer.model_dump(mode="json", by_alias=True), "formatVersion": versions.FORMAT_VERSION + 1}
        (tmp_path / "future.json").write_text(json.dumps(future))
        cards._custom.clear()
        cards.load_custom_cards(tmp_path)
        assert cards.get_card("test/versioned") == ours and cards.get_card("test/version-one") == old
        assert cards.get_card("test/from-the-future") is None
        assert json.loads((tmp_path / "old.json.v1.bak").read_text()) == old.model_dump(mode="json", by_alias=True)
        assert json.loads((tmp_path / "old.json").read_text())["formatVersion"] == versions.FORMAT_VERSION
        assert json.loads((tmp_path / "future.json").read_text()) == future, "a newer card is left untouched"
    finally:
        cards._custom.clear()


def test_traces_of_version_one_are_read_as_they_are_newer_ones_not_at_all(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, "n1")
    header = {"taskId": "old", "createdAt": "2026-01-01T00:00:00+00:00", "modelId": "m", "taskKind": "chat"}
    (tmp_path / "old.jsonl").write_text(json.dumps(header) + "\n")
    newer = {**header, "taskId": "new", "formatVersion": versions.FORMAT_VERSION + 1}
    (tmp_path / "new.jsonl").write_text(json.dumps(newer) + "\n")
    assert [t["taskId"] for t in store.summaries()] == ["old"]
    assert store._header("t", None, None)["formatVersion"] == versions.FORMAT_VERSION
    assert "formatVersion" not in store.summaries()[0]


def test_a_migration_without_room_leaves_the_event_log_as_it_was(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    original = _v1_records(2)
    (tmp_path / "events.jsonl").write_bytes(original)

    def full(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eventlog_module.shutil, "copy2", full)
    log = _open(tmp_path)
    try:
        assert log.counting_only and log.refused is not None and "could not migrate" in log.refused
    finally:
        log.close()
    assert (tmp_path / "events.jsonl").read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive", "events.jsonl"]


def test_a_json_file_that_cannot_be_rewritten_is_used_migrated_in_memory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "desired.json"
    path.write_text('{"metaInstances": {}}')

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(file_format.shutil, "copy2", read_only)
    used = json.loads(file_format.bring_up_to_date(path, path.read_bytes()))
    assert used["formatVersion"] == versions.FORMAT_VERSION and path.read_text() == '{"metaInstances": {}}'
