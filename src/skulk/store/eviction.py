"""Eviction of staged copies: one mechanism, three triggers (instance deactivation, node startup, operator
purge), as the runbook says.

A staged model is a candidate only when no live runner on this node uses it (companions included: the caller
passes every model id a live runner depends on). Candidates are kept newest-first by last use up to
`staging_keep_recent_gb`; everything beyond is deleted. The decision is a pure function; the shell scans the
staging root, deletes, and logs one line per eviction with size and age.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from skulk.store.files import read_marker, tree_bytes

log = logging.getLogger("skulk.store")

LAST_USED = ".skulk-last-used"
GIB = 1024**3


@dataclass(frozen=True)
class StagedModel:
    model_id: str
    path: Path
    bytes: int
    last_used: float
    in_use: bool


def to_evict(staged: list[StagedModel], keep_recent_bytes: int) -> list[StagedModel]:
    """Not-in-use copies beyond the grace budget: keep the newest by last use while they fit, drop the rest."""
    candidates = sorted((s for s in staged if not s.in_use), key=lambda s: s.last_used, reverse=True)
    kept = 0
    evicted: list[StagedModel] = []
    for model in candidates:
        if not evicted and kept + model.bytes <= keep_recent_bytes:
            kept += model.bytes
        else:
            evicted.append(model)
    return evicted


def to_purge(staged: list[StagedModel], model_id: str | None) -> list[StagedModel]:
    """An operator purge: every not-in-use copy, or only model_id's."""
    return [s for s in staged if not s.in_use and (model_id is None or s.model_id == model_id)]


def model_id_of(path: Path) -> str:
    marker = read_marker(path)
    return marker.model_id if marker is not None else path.name.replace("--", "/", 1)


def scan(root: Path, in_use: set[str]) -> list[StagedModel]:
    """Every model directory under the staging root."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        model_id = model_id_of(path)
        stamp = path / LAST_USED
        last_used = stamp.stat().st_mtime if stamp.exists() else path.stat().st_mtime
        found.append(StagedModel(model_id, path, tree_bytes(path), last_used, model_id in in_use))
    return found


def touch(path: Path) -> None:
    """Record a use of a staged copy (its runner starts, or its instance stops)."""
    if path.is_dir():
        (path / LAST_USED).touch()


def remove(models: list[StagedModel], why: str) -> list[str]:
    """Delete each copy, one log line each with size and age; the ids removed."""
    removed = []
    now = time.time()
    for model in models:
        shutil.rmtree(model.path, ignore_errors=True)
        age_h = (now - model.last_used) / 3600
        log.info(
            "evicted staged %s (%.2f GiB, last used %.1f h ago) on %s", model.model_id, model.bytes / GIB, age_h, why
        )
        removed.append(model.model_id)
    return removed
