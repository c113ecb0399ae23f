"""Where a recovery's time goes, read from the nodes' own event logs (GET /events), not guessed from outside.

Every node writes each event of the master's log with the wall-clock time it applied it (`at`); the bench
reads the logs of the nodes that are up, keeps each event's earliest `at` (the master's, or the first follower
to apply it), and names the phases after a fault at wall time t0 (issue 38):

  detect  t0 → the cluster notices: the lost node's NodeTimedOut, an instance of it deleted or retrying, a
          runner failed. After a master's death no node can write such an event before a new master exists,
          so there detect is the new session's start, and equals elect.
  elect   t0 → a new master's SessionStarted (only where the master died, or every node restarted)
  place   t0 → the InstanceCreated of the replacement (of the MetaInstance, when one is named)
  load    t0 → every runner of that instance reported RunnerReady (spawn, imports, weights, warmup)
The bench adds what no event marks: `token` (t0 → the first token of a streamed chat) and, for a full
restart, `boot` (t0, every node started → every node's API answers).

Pure functions over the records, so the split is tested without nodes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx

from skulk.testing.nodes import LocalNode
from skulk.testing.streams import stream_chunk

PHASES = ("detect", "boot", "elect", "place", "load", "token")

Record = dict[str, Any]


def _tagged(value: Any) -> tuple[str, dict[str, Any]] | None:
    """("Kind", fields) of a one-key tagged union value, as the wire writes it."""
    if isinstance(value, dict) and len(value) == 1:
        ((kind, body),) = value.items()
        if isinstance(body, dict):
            return kind, body
    return None


def master_events(records: Iterable[Record]) -> list[tuple[float, str, dict[str, Any]]]:
    """(earliest at, kind, fields) of each master event in the records, oldest first; every other record (a
    request tap's) is skipped. An event applied by several nodes is the same (master, term, idx)."""
    earliest: dict[tuple[Any, Any, Any], tuple[float, str, dict[str, Any]]] = {}
    for record in records:
        indexed = record.get("event")
        if not isinstance(indexed, dict) or "idx" not in indexed:
            continue
        tagged = _tagged(indexed.get("event"))
        if tagged is None:
            continue
        key = (indexed.get("master"), indexed.get("term"), indexed["idx"])
        at = float(record["at"])
        if key not in earliest or at < earliest[key][0]:
            earliest[key] = (at, *tagged)
    return sorted(earliest.values(), key=lambda e: e[0])


def _instance(fields: dict[str, Any]) -> tuple[str, str | None, list[str]]:
    """(instance id, MetaInstance id, runner ids) of an InstanceCreated's instance."""
    tagged = _tagged(fields.get("instance"))
    body = tagged[1] if tagged else {}
    runners = list(body.get("shardAssignments", {}).get("runnerToShard", {}))
    return str(body.get("instanceId")), body.get("metaInstanceId"), runners


def _detects(kind: str, fields: dict[str, Any], victim: str | None, old: set[str]) -> bool:
    if kind == "NodeTimedOut":
        return victim is None or fields.get("nodeId") == victim
    if kind in ("InstanceDeleted", "InstanceRetrying"):
        return fields.get("instanceId") in old
    if kind == "RunnerStatusUpdated":
        return _tagged(fields.get("runnerStatus")) is not None and "RunnerFailed" in fields["runnerStatus"]
    return kind == "SessionStarted"


def split(
    records: Iterable[Record],
    t0: float,
    *,
    victim: str | None = None,
    meta_id: str | None = None,
    old: Iterable[str] = (),
    detect: bool = True,
) -> dict[str, float]:
    """Seconds from t0 to each phase's end that the records show (a phase not reached is absent). detect=False
    where nothing is to be noticed (every node restarted: the fault is the start itself)."""
    old_ids = set(old)
    marks: dict[str, float] = {}
    runners: list[str] = []
    ready: set[str] = set()
    for at, kind, fields in master_events(records):
        if at < t0:
            continue
        since = at - t0
        if detect and "detect" not in marks and _detects(kind, fields, victim, old_ids):
            marks["detect"] = since
        if kind == "SessionStarted" and "elect" not in marks:
            marks["elect"] = since
        if kind == "InstanceCreated" and "place" not in marks:
            instance_id, meta, ids = _instance(fields)
            if instance_id not in old_ids and (meta_id is None or meta == meta_id):
                marks["place"], runners = since, ids
        if kind == "RunnerStatusUpdated" and fields.get("runnerId") in runners:
            status = _tagged(fields.get("runnerStatus"))
            if status is not None and status[0] in ("RunnerReady", "RunnerRunning"):
                ready.add(fields["runnerId"])
                if ready >= set(runners) and "load" not in marks:
                    marks["load"] = since
    return marks


def durations(marks: dict[str, float]) -> dict[str, float]:
    """Each phase's own share: from the latest earlier phase reached to its end (cumulative marks → parts)."""
    parts: dict[str, float] = {}
    previous = 0.0
    for phase in PHASES:
        if phase in marks:
            parts[phase] = max(0.0, marks[phase] - previous)
            previous = max(previous, marks[phase])
    return parts


# -- thin I/O shells: read a node's log, time a chat's first token -------------------------------------------
def last_seq(node: LocalNode) -> int:
    """Where `node`'s event log stands now: read after this to see only what follows."""
    page = node.get("/events?limit=1&since=1000000000000", timeout=5) or {}
    return int(page.get("lastSeq", 0))


def read_after(node: LocalNode, since: int, timeout: float = 2.0) -> tuple[list[Record], int]:
    """Every record of `node`'s event log after seq `since` (paged) and the seq to continue from; ([], since)
    when the node does not answer (it is the one killed, or paused)."""
    found: list[Record] = []
    while True:
        try:
            reply = httpx.get(f"{node.url}/events", params={"since": since, "limit": 10_000}, timeout=timeout,
                              trust_env=False)
        except httpx.HTTPError:
            return found, since
        if reply.status_code != 200:
            return found, since
        page = reply.json()
        found += page["events"]
        if not page["events"]:
            return found, since
        since = int(page["nextSince"])


def first_token_at(node: LocalNode, model: str, timeout: float = 30.0) -> float | None:
    """Wall time of the first token of a short streamed chat through `node`; None if the chat failed."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    try:
        with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=timeout,
                          trust_env=False) as reply:
            if reply.status_code != 200:
                return None
            for line in reply.iter_lines():
                if stream_chunk(line) == -1:
                    return time.time()
    except (httpx.HTTPError, RuntimeError):
        return None
    return None
