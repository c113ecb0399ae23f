"""Format versions of the node's JSON files at start: migrate an older file (a backup kept beside it), refuse a
newer one (left untouched). The decision is `types/versions.file_action`; this is its thin I/O shell.

Version 1 (the release before versioning) wrote the same objects without `formatVersion`, so its migration is
to stamp the field; a later version that changes a file's shape adds its step to `_STEPS`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skulk.types import versions
from skulk.types.versions import FileAction

log = logging.getLogger(__name__)

_STEPS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: lambda data: {**data, versions.FILE_FIELD: 2},
}
"""Each step takes a file's object from version n to n + 1."""


def migrated(data: dict[str, Any], found: int) -> dict[str, Any]:
    """`data`, of version `found`, in FORMAT_VERSION (pure)."""
    for version in range(found, versions.FORMAT_VERSION):
        data = _STEPS[version](data)
    return {**data, versions.FILE_FIELD: versions.FORMAT_VERSION}


def stamped(data: dict[str, Any]) -> dict[str, Any]:
    """What this release writes: the object with its format version first."""
    return {versions.FILE_FIELD: versions.FORMAT_VERSION, **data}


class RefusedFile(Exception):
    """A file of a format newer than this release (or unreadable): its message says both and what to do."""


def bring_up_to_date(path: Path, raw: bytes) -> bytes:
    """The file's bytes in this release's format: as read when current (or not a JSON object: the caller's own
    checks say what is wrong with it); else the older file copied to `<file>.v<n>.bak` and rewritten migrated
    (atomically). Raises RefusedFile, touching nothing, for a newer version."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(data, dict):
        return raw
    found = versions.file_version(data)
    action = versions.file_action(found)
    if action is FileAction.refuse:
        raise RefusedFile(versions.file_refusal(str(path), found))
    if action is FileAction.current:
        return raw
    assert found is not None
    updated = json.dumps(migrated(data, found)).encode()
    backup = path.with_name(versions.backup_name(path.name, found))
    try:
        shutil.copy2(path, backup)
        write_atomically(path, updated)
    except OSError as exc:  # a read-only home: used migrated in memory, the file stays as it was
        log.warning("could not migrate %s from format version %d to %d (%s); using it as read", path, found,
                    versions.FORMAT_VERSION, exc)
        return updated
    log.warning("migrated %s from format version %d to %d; the old file is kept as %s", path, found,
                versions.FORMAT_VERSION, backup)
    return updated


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".migrating")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
