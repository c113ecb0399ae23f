"""Desired state that outlives the cluster: what an operator created on purpose survives a full restart.

The cluster state lives in memory and is replicated, so a power cut of every node forgot it all, though the
README calls a MetaInstance "an instance that always exists" (issue 27). Every node therefore writes the part of
the state an operator asked for (MetaInstances, custom model cards, the tracing switch) to `<home>/desired.json`
whenever it changes, and the first master of a cluster (one elected with no event applied anywhere: nobody had
state to hand it) restores its own copy as events, after which the reconciler places the MetaInstances again.

What does not survive: instances placed with /place_instance (they name node ids, and a node id is its zenoh
session's, new at every start), tasks, runners, downloads and everything measured. A MetaInstance pinned to node
ids comes back unpinned, for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from skulk import file_format
from skulk.types.base import CamelModel
from skulk.types.desired import RestoredCopy, rank_of
from skulk.types.diagnostics_bundle import SkippedDesiredEntry
from skulk.types.events import Event, MetaInstanceCreated, ModelCardAdded, TracingStateChanged
from skulk.types.ids import MetaInstanceId, ModelId, NodeId
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import ModelCard
from skulk.types.state import State

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

FILE_NAME = "desired.json"
SAVE_DELAY_S = 0.5
MAX_ENTRIES = 4096
"""Per map of the file: far beyond any operator's, and a bound on what a peer's offered copy may cost."""
HOLD_S = 45.0
"""How long a node keeps its own good file unwritten while the cluster restored a worse copy (or none): time for
its offer to reach the first master (state/desired_offer.OFFER_WINDOW_S), plus slack."""


class DesiredState(CamelModel):
    """The operator's intent, without anything measured (failure counts, placement errors) or session-bound."""

    meta_instances: dict[MetaInstanceId, MetaInstance] = {}
    model_cards: dict[ModelId, ModelCard] = {}
    tracing_enabled: bool | None = None


def desired_of(state: State) -> DesiredState:
    """The part of `state` that a restart must bring back (pure)."""
    metas = {
        mid: MetaInstance(meta_instance_id=m.meta_instance_id, model_id=m.model_id, sharding=m.sharding,
                          instance_meta=m.instance_meta, min_nodes=m.min_nodes, node_ids=m.node_ids,
                          kv_cache_gb=m.kv_cache_gb, max_context=m.max_context,
                          kv_cache_bits=m.kv_cache_bits)
        for mid, m in state.meta_instances.items()
    }
    return DesiredState(meta_instances=metas, model_cards=dict(state.model_cards),
                        tracing_enabled=state.tracing_enabled)


def restore_events(state: State, desired: DesiredState) -> list[Event]:
    """Events that bring `desired` into a fresh `state` (pure): what the state already has is left alone. Node
    pins are dropped: the ids they name belonged to sessions that ended with the restart."""
    cards: list[Event] = [ModelCardAdded(card=c) for mid, c in sorted(desired.model_cards.items())
                          if mid not in state.model_cards]
    metas: list[Event] = [
        MetaInstanceCreated(meta_instance=m.model_copy(update={"node_ids": None}))
        for mid, m in sorted(desired.meta_instances.items())
        if mid not in state.meta_instances
    ]
    tracing: list[Event] = []
    if desired.tracing_enabled is not None and state.tracing_enabled is None:
        tracing.append(TracingStateChanged(enabled=desired.tracing_enabled))
    return [*cards, *metas, *tracing]


def parse_desired(raw: bytes) -> tuple[DesiredState | None, list[SkippedDesiredEntry]]:
    """The desired state in a file's bytes, entry by entry (pure); (None, [file]) when not JSON."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return None, [SkippedDesiredEntry(entry="file", reason=f"not JSON: {exc}")]
    return parse_desired_object(data)


def parse_desired_object(data: object) -> tuple[DesiredState | None, list[SkippedDesiredEntry]]:
    """The desired state in a file's JSON value, entry by entry (pure): each MetaInstance, model card and the
    tracing switch validated on its own, so one bad entry costs that entry. (None, [file]) when the value is not
    a JSON object at all. The same check for a node's own file and for a copy a peer offers (never trusted)."""
    if not isinstance(data, dict):
        return None, [SkippedDesiredEntry(entry="file", reason=f"not a JSON object but {type(data).__name__}")]
    skipped: list[SkippedDesiredEntry] = []
    metas = _entries(data, "metaInstances", MetaInstance, skipped)
    cards = _entries(data, "modelCards", ModelCard, skipped)
    tracing = data.get("tracingEnabled")
    if tracing is not None and not isinstance(tracing, bool):
        skipped.append(SkippedDesiredEntry(entry="tracingEnabled", reason=f"not a boolean: {tracing!r}"[:200]))
        tracing = None
    desired = DesiredState(
        meta_instances={MetaInstanceId(k): v for k, v in metas.items()
                        if _named(f"metaInstances.{k}", k, v.meta_instance_id, skipped)},
        model_cards={ModelId(k): v for k, v in cards.items() if _named(f"modelCards.{k}", k, v.model_id, skipped)},
        tracing_enabled=tracing)
    return desired, skipped


def saved_at_of(data: object) -> datetime | None:
    """When the file was written (`savedAt`), or None: a file from before the field, or one that says nothing
    usable (it then ranks oldest; that is no reason to skip an entry)."""
    if not isinstance(data, dict) or not isinstance(data.get("savedAt"), str):
        return None
    try:
        saved = datetime.fromisoformat(data["savedAt"])
    except ValueError:
        return None
    return saved if saved.tzinfo is not None else saved.replace(tzinfo=UTC)


def _named(entry: str, key: str, own_id: str, skipped: list[SkippedDesiredEntry]) -> bool:
    """An entry is filed under its own id; one filed under another would be created twice or never deleted."""
    if key == own_id:
        return True
    skipped.append(SkippedDesiredEntry(entry=entry[:200], reason=f"filed under another id ({own_id!r})"[:200]))
    return False


def _entries(data: dict[str, Any], key: str, model: type[M],
             skipped: list[SkippedDesiredEntry]) -> dict[str, M]:
    """The valid entries of one map of the file; each invalid one added to `skipped` with its first error."""
    found = data.get(key) or {}
    if not isinstance(found, dict):
        skipped.append(SkippedDesiredEntry(entry=key, reason=f"not an object but {type(found).__name__}"))
        return {}
    kept: dict[str, M] = {}
    for index, (name, value) in enumerate(found.items()):
        if index >= MAX_ENTRIES:
            skipped.append(SkippedDesiredEntry(entry=key, reason=f"over {MAX_ENTRIES} entries: the rest skipped"))
            break
        try:
            kept[name] = model.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "entry"
            skipped.append(SkippedDesiredEntry(entry=f"{key}.{name}", reason=f"{where}: {first['msg']}"))
    return kept


class DesiredStateFile:
    """`<home>/desired.json`: read once when the node starts (`saved`, what a first master restores and a
    follower offers), rewritten (atomically, fsynced, stamped `savedAt`) when the desired part of the state
    changed, at most every SAVE_DELAY_S: a restarted cluster's first events (an empty session, then the restore)
    coalesce into one write. A follower whose copy ranks above what the cluster restored keeps its file as it is
    (up to HOLD_S) until its offer is restored, so a master with no copy or a corrupt one never costs it its
    good file."""

    def __init__(self, home: Path) -> None:
        self.path = home / FILE_NAME
        self.skipped: list[SkippedDesiredEntry] = []
        """What the start could not restore from the file (diagnostics' desiredStateSkipped)."""
        self.raw: dict[str, Any] | None = None
        """The file's JSON object as read, what this node offers a master (which validates it itself)."""
        self.saved_at: datetime | None = None
        self.refused: str | None = None
        """Why the file was not used (a format newer than this release): it is then never written either."""
        self.saved = self._load()
        self._last: DesiredState | None = self.saved
        self._last_seen: tuple[object, ...] | None = None
        self._pending: State | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._hold_until = time.monotonic() + HOLD_S
        self._held = False

    def copy_of(self, node_id: NodeId) -> RestoredCopy | None:
        """How this node's saved copy ranks (None: it has none): whole when nothing was skipped."""
        if self.saved is None:
            return None
        return RestoredCopy(source=node_id, whole=not self.skipped, saved_at=self.saved_at)

    def _load(self) -> DesiredState | None:
        """What was saved, entry by entry (None: no file). A bad entry is skipped and named (log, diagnostics),
        the rest restored; a file not read whole is first kept aside (`desired.json.corrupt-<time>`), since the
        next save rewrites it with what was restored. Never fatal."""
        try:
            raw = file_format.bring_up_to_date(self.path, self.path.read_bytes())
        except FileNotFoundError:
            return None
        except file_format.RefusedFile as exc:
            self.refused = str(exc)
            log.error("desired state: %s", exc)
            return None
        except OSError as exc:
            raw, self.skipped = None, [SkippedDesiredEntry(entry="file", reason=f"unreadable: {exc}")]
        desired = None
        if raw is not None:
            desired, self.skipped = parse_desired(raw)
            if desired is not None:
                self.raw, self.saved_at = json.loads(raw), saved_at_of(json.loads(raw))
        if self.skipped:
            kept = self._keep_aside()
            self.skipped = [s.model_copy(update={"kept_at": kept}) for s in self.skipped]
            for skipped in self.skipped:
                log.error("desired state: skipped %s of %s (%s); the file was kept as %s", skipped.entry,
                          self.path, skipped.reason, kept)
        return desired

    def _keep_aside(self) -> str | None:
        """A copy of the file as it was read, beside it; None when even that failed (logged)."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        try:
            shutil.copy2(self.path, aside)
        except OSError as exc:
            log.error("could not keep a copy of %s aside: %s", self.path, exc)
            return None
        return str(aside)

    def observe(self, state: State) -> None:
        """After each change of state, on the event loop; cheap when nothing desired changed (apply keeps
        unchanged maps as they were, so identity says it). A state without a master is never saved."""
        seen = (state.meta_instances, state.model_cards, state.tracing_enabled, state.desired_restored)
        if self._last_seen is not None and all(a is b for a, b in zip(seen, self._last_seen, strict=True)):
            return
        self._last_seen = seen
        if state.master_node_id is None:
            return
        self._pending = state
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SAVE_DELAY_S, self.flush)

    def flush(self) -> None:
        """Write the latest observed state's desired part if it differs from what is on disk, unless this
        node's own copy is still the better one (`_holding`): then try again a little later."""
        self._timer = None
        state, self._pending = self._pending, None
        if state is None or self.refused is not None:
            return
        if self._holding(state):
            self._pending = state
            with contextlib.suppress(RuntimeError):  # no loop: a unit test's or the last flush at shutdown
                self._timer = asyncio.get_running_loop().call_later(SAVE_DELAY_S, self.flush)
            return
        desired = desired_of(state)
        if desired == self._last:
            return
        try:
            self._write(desired)
            self._last = desired
        except OSError as exc:
            log.warning("could not save the desired state to %s: %s", self.path, exc)

    def _holding(self, state: State) -> bool:
        """True while this node's own copy is better than the one the cluster restored (whole against partial,
        any against none: the age is left out, so a node rejoining a running cluster does not hold) and HOLD_S
        has not passed since the start: its offer may still be restored, and writing now would replace a good
        file with less."""
        better = rank_of(self.copy_of(NodeId("")))[:2] > rank_of(state.desired_restored)[:2]
        if better and time.monotonic() < self._hold_until:
            if not self._held:
                log.info("keeping %s as it is until the cluster restores it (it holds more than the cluster has)",
                         self.path)
            self._held = True
            return True
        if better and self._held:
            log.warning("the cluster did not restore this node's copy of the desired state within %.0f s; "
                        "%s now follows the cluster's", HOLD_S, self.path)
        self._held = False
        return False

    def _write(self, desired: DesiredState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            stamp = datetime.now(UTC).isoformat()
            json.dump(file_format.stamped({"savedAt": stamp, **desired.model_dump(mode="json", by_alias=True)}), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
