"""Format versions: one number for everything a node says to another node or leaves on disk, and the rule that
decides whether a peer or a file of another version is taken.

A rolling upgrade restarts one node at a time, so for a while nodes of two releases share a cluster and a node
finds files an older release wrote. Every wire message and persisted file therefore carries `FORMAT_VERSION`:

- zenoh messages (puts, query replies and queries: events, commands, local events, chunks, election heartbeats,
  payloads, snapshots and ranges) carry it as the zenoh attachment `ATTACHMENT_PREFIX + "<n>"`, beside the
  payload rather than inside it: the payload types forbid unknown keys, so a field would make a node of the
  previous release drop every message of this one;
- node-to-node HTTP (the API's internal routes and the store's file server) carries the header `HEADER`;
- `desired.json` carries `"formatVersion"` (`FILE_FIELD`), each event-log record `"v"` (`RECORD_FIELD`).

A field a release adds to a wire type is left out while it holds its default (`Field(exclude_if=...)`, as
`MemoryUsage.runner_overheads`), so a peer one release behind, whose types forbid unknown keys, still reads the
message until the new feature is used; from then it drops those messages until it is upgraded.

What carries no version is version 1 (`UNVERSIONED`): the release before versioning (commit 8f0fa60), which this
one interoperates with. A peer within one version of ours is worked with; any other is refused with one log line
naming both versions and which side to upgrade (`judge`, `refusal_line`). A file of an older version is migrated
on start with a backup beside it; a newer one is refused and left untouched (`file_action`).
"""

from __future__ import annotations

from enum import StrEnum

FORMAT_VERSION = 2
"""This release's format. 1: the release before versioning; 2: every message and file says its version."""
UNVERSIONED = 1
"""The version of a message, call or file that says none: what the previous release wrote."""
TOLERANCE = 1
"""How far apart a peer's version may be from ours and still be worked with."""

ATTACHMENT_PREFIX = b"skulk-format="
HEADER = "x-skulk-format"
FILE_FIELD = "formatVersion"
RECORD_FIELD = "v"


class Compat(StrEnum):
    """What a node does with a peer's message of a given version."""

    same = "same"
    compatible = "compatible"
    peer_older = "peer_older"
    """Refused: the peer is more than TOLERANCE behind; upgrade the peer."""
    peer_newer = "peer_newer"
    """Refused: the peer is more than TOLERANCE ahead; upgrade this node."""
    unreadable = "unreadable"
    """Refused: the version itself did not parse (not a node of any release)."""


def judge(theirs: int | None, ours: int = FORMAT_VERSION) -> Compat:
    """The decision for a peer speaking `theirs` (None: a version that did not parse); pure."""
    if theirs is None:
        return Compat.unreadable
    if theirs == ours:
        return Compat.same
    if abs(theirs - ours) <= TOLERANCE:
        return Compat.compatible
    return Compat.peer_older if theirs < ours else Compat.peer_newer


def accepted(verdict: Compat) -> bool:
    return verdict in (Compat.same, Compat.compatible)


def refusal_line(what: str, theirs: int | None, ours: int = FORMAT_VERSION) -> str:
    """The one log line of a refused peer: both versions and what to upgrade."""
    verdict = judge(theirs, ours)
    if verdict is Compat.peer_older:
        advice = f"upgrade {what} to a release of format {ours - TOLERANCE} or later"
    elif verdict is Compat.peer_newer:
        advice = f"upgrade this node to a release of format {theirs - TOLERANCE if theirs else ours} or later"
    else:
        advice = "it is not a Skulk node of any release"
    return (f"refusing {what}: it speaks format version {theirs if theirs is not None else 'unreadable'}, this "
            f"node speaks {ours} (accepts {ours - TOLERANCE}..{ours + TOLERANCE}); {advice}")


def attachment(version: int = FORMAT_VERSION) -> bytes:
    return ATTACHMENT_PREFIX + str(version).encode()


def version_of_attachment(raw: bytes | None) -> int | None:
    """A zenoh message's version: UNVERSIONED without an attachment, None when it is not ours or not a number."""
    if raw is None or raw == b"":
        return UNVERSIONED
    if not raw.startswith(ATTACHMENT_PREFIX):
        return None
    return _number(raw[len(ATTACHMENT_PREFIX):].decode("latin-1"))


def version_of_header(value: str | None) -> int | None:
    """An HTTP call's version: UNVERSIONED without the header, None when it is not a number."""
    return UNVERSIONED if value is None else _number(value)


def _number(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and len(text) < 6 else None


class FileAction(StrEnum):
    """What a node does at start with a persisted file of a given version."""

    current = "current"
    migrate = "migrate"
    """Older: back it up beside itself (`<file>.v<n>.bak`) and rewrite it in FORMAT_VERSION."""
    refuse = "refuse"
    """Newer than this release knows (or unreadable): leave it untouched and say which release wrote it."""


def file_action(found: int | None, ours: int = FORMAT_VERSION) -> FileAction:
    if found is None or found > ours:
        return FileAction.refuse
    return FileAction.current if found == ours else FileAction.migrate


def file_version(data: object) -> int | None:
    """The version a JSON file's top-level object says (UNVERSIONED without the field; None if not a number)."""
    if not isinstance(data, dict) or FILE_FIELD not in data:
        return UNVERSIONED
    found = data[FILE_FIELD]
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None


def backup_name(name: str, version: int) -> str:
    return f"{name}.v{version}.bak"


def file_refusal(path: str, found: int | None, ours: int = FORMAT_VERSION) -> str:
    said = "an unreadable format version" if found is None else f"format version {found}"
    return (f"{path} has {said}, newer than this node's {ours}: left untouched and not used; upgrade this node "
            f"to the release that wrote it (or move the file away to start without it)")
