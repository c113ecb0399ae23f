"""This node's saved traces: one file per task under <home>/traces, spans appended as they arrive.

`<task_id>.jsonl`: a header line (formatVersion, taskId, createdAt, modelId, taskKind; types/versions.py: a header
without formatVersion is version 1, read as it is, and a newer one is not read) then one TraceSpan per line. Only
spans of traced tasks ever reach it (tracing off: nothing is written). The summaries (stats, the Chrome
trace-event export) are pure functions of spans, so the cluster views merge peers' spans and reuse them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skulk.types import versions
from skulk.types.tracing import TraceSpan
from skulk.types.versions import FileAction

log = logging.getLogger("skulk.tracing")

_TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
API_PID = 1_000_000
"""Chrome-trace pid of the API node's own spans (ranks use their rank as pid)."""


def valid_task_id(task_id: str) -> bool:
    """Task ids name files: nothing that could address a path outside the traces directory."""
    return bool(_TASK_ID.fullmatch(task_id))


class TraceStore:
    def __init__(self, directory: Path, node_id: str) -> None:
        self.directory = directory
        self.node_id = node_id
        self._lock = threading.Lock()

    def _path(self, task_id: str) -> Path:
        return self.directory / f"{task_id}.jsonl"

    def add(self, spans: list[TraceSpan], model_id: str | None, task_kind: str | None) -> None:
        """Append spans (one task or several), stamped with this node's id; small writes, traced tasks only."""
        by_task: dict[str, list[TraceSpan]] = defaultdict(list)
        for span in spans:
            if valid_task_id(span.task_id):
                by_task[span.task_id].append(span.model_copy(update={"node_id": span.node_id or self.node_id}))
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            for task_id, found in by_task.items():
                path = self._path(task_id)
                lines = [] if path.exists() else [json.dumps(self._header(task_id, model_id, task_kind))]
                lines += [s.model_dump_json() for s in found]
                with path.open("a") as f:
                    f.write("\n".join(lines) + "\n")

    def _header(self, task_id: str, model_id: str | None, task_kind: str | None) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        return {versions.FILE_FIELD: versions.FORMAT_VERSION, "taskId": task_id, "createdAt": now,
                "modelId": model_id, "taskKind": task_kind}

    def _read(self, task_id: str) -> tuple[dict[str, Any], list[TraceSpan]] | None:
        path = self._path(task_id)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return None
        header = json.loads(lines[0])
        found = versions.file_version(header)
        if versions.file_action(found) is FileAction.refuse:  # a newer release's trace: left alone, not shown
            log.warning("%s", versions.file_refusal(str(path), found))
            return None
        if isinstance(header, dict):
            header.pop(versions.FILE_FIELD, None)  # version 1 wrote the same lines without it: read as they are
        spans = []
        for line in lines[1:]:
            try:
                spans.append(TraceSpan.model_validate_json(line))
            except ValueError:  # a torn last line of a node killed mid-append
                continue
        return header, spans

    def summaries(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted(self.directory.glob("*.jsonl")) if self.directory.exists() else []:
            read = self._read(path.stem)
            if read is None:
                continue
            header, spans = read
            found.append({**header, "fileSize": path.stat().st_size, "spanCount": len(spans),
                          "sourceNodes": sorted({s.node_id or self.node_id for s in spans})})
        return sorted(found, key=lambda t: t["createdAt"], reverse=True)

    def spans(self, task_id: str) -> tuple[dict[str, Any], list[TraceSpan]] | None:
        if not valid_task_id(task_id):
            return None
        with self._lock:
            return self._read(task_id)

    def delete(self, task_ids: list[str]) -> list[str]:
        deleted = []
        with self._lock:
            for task_id in task_ids:
                if valid_task_id(task_id) and self._path(task_id).exists():
                    self._path(task_id).unlink()
                    deleted.append(task_id)
        return deleted

    def prune(self, retention_days: float, now: float | None = None) -> list[str]:
        """The janitor: delete traces last written more than retention_days ago; 0 keeps everything."""
        if retention_days <= 0 or not self.directory.exists():
            return []
        cutoff = (now if now is not None else time.time()) - retention_days * 86_400
        old = [p.stem for p in self.directory.glob("*.jsonl") if p.stat().st_mtime < cutoff]
        deleted = self.delete(old)
        if deleted:
            log.info("trace janitor deleted %d traces older than %g days", len(deleted), retention_days)
        return deleted


def merge_spans(groups: list[list[TraceSpan]]) -> list[TraceSpan]:
    """Spans from several nodes, each once (a span is identified by everything it says), in time order."""
    seen: dict[str, TraceSpan] = {}
    for spans in groups:
        for span in spans:
            seen.setdefault(span.model_dump_json(), span)
    return sorted(seen.values(), key=lambda s: (s.start_us, s.rank if s.rank is not None else -1))


def stats(task_id: str, spans: list[TraceSpan]) -> dict[str, Any]:
    """{taskId, totalWallTimeUs, byCategory, byRank, sourceNodes}: where the time of one request went."""
    if not spans:
        return {"taskId": task_id, "totalWallTimeUs": 0, "byCategory": {}, "byRank": {}, "sourceNodes": []}
    start = min(s.start_us for s in spans)
    end = max(s.start_us + s.duration_us for s in spans)
    by_category: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "totalUs": 0})
    by_rank: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "totalUs": 0})
    for span in spans:
        for bucket in (by_category[span.name], by_rank["api" if span.rank is None else str(span.rank)]):
            bucket["count"] += 1
            bucket["totalUs"] += span.duration_us
        waited = span.args.get("pipelineWaitUs")
        if isinstance(waited, int) and waited > 0:  # inside prefill/decode spans: time spent waiting on peers
            by_category["pipeline_wait"]["count"] += 1
            by_category["pipeline_wait"]["totalUs"] += waited
    return {
        "taskId": task_id,
        "totalWallTimeUs": end - start,
        "byCategory": dict(by_category),
        "byRank": dict(by_rank),
        "sourceNodes": sorted({s.node_id for s in spans if s.node_id}),
    }


def chrome_trace(task_id: str, spans: list[TraceSpan]) -> dict[str, Any]:
    """Chrome trace-event JSON (complete events, "ph": "X"), which Perfetto and chrome://tracing open."""
    events: list[dict[str, Any]] = []
    pids: dict[int, str] = {}
    for span in spans:
        pid = API_PID if span.rank is None else span.rank
        pids.setdefault(pid, "API" if span.rank is None else f"rank {span.rank}")
        events.append({
            "name": span.name, "cat": span.category, "ph": "X", "ts": span.start_us, "dur": span.duration_us,
            "pid": pid, "tid": 0, "args": {**span.args, "taskId": task_id, "nodeId": span.node_id},
        })
    for pid, name in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"taskId": task_id}}
