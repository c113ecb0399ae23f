"""This node's own OS processes: the Skulk process and its descendants (runners and helpers), nothing else.

Other processes on the host are none of the cluster's business: their command lines can carry secrets and
show what else a machine runs, and diagnostics are readable by every admin of the cluster. One pass over the
tree with prefetched attributes, capped at MAX_PROCESSES rows. Processes that vanish mid-scan are skipped.
Blocking: run it off the event loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection

import psutil

from skulk import redact
from skulk.types.diagnostics_bundle import ProcessDiagnostics, ProcessRole
from skulk.types.memory import Memory

MAX_PROCESSES = 64
COMMAND_CHARS = 400
_ATTRS = ["pid", "ppid", "name", "cmdline", "status", "cpu_percent", "memory_percent", "memory_info"]
_ATTRS += ["create_time"]


def _tree(root: int) -> set[int]:
    try:
        return {root, *(child.pid for child in psutil.Process(root).children(recursive=True))}
    except psutil.Error:
        return {root}


def _command(info: dict[str, object]) -> str:
    cmdline = info.get("cmdline")
    if isinstance(cmdline, list) and cmdline:
        text = " ".join(redact.command_line([str(part) for part in cmdline]))
    else:
        text = redact.scrub(str(info.get("name") or ""))
    return text[:COMMAND_CHARS]


def _is_python(name: str, command: str) -> bool:
    return "python" in name.lower() or "python" in command.split(" ", 1)[0].lower()


def classify(
    pid: int, name: str, command: str, root: int, runner_pids: Collection[int], in_tree: bool
) -> ProcessRole | None:
    """Best-effort role; None for processes outside Skulk's tree that are not worth listing."""
    lowered = command.lower()
    if pid == root:
        return "skulk"
    if pid in runner_pids or (in_tree and "multiprocessing.spawn" in lowered and "spawn_main" in lowered):
        return "runner"
    if name == "vector" or lowered.startswith("vector "):
        return "vector"
    if not in_tree and "skulk" in lowered and _is_python(name, command):
        return "skulk"
    if _is_python(name, command):
        return "python"
    return "other" if in_tree else None


def _row(info: dict[str, object], role: ProcessRole, in_tree: bool, now: float) -> ProcessDiagnostics:
    mem = info.get("memory_info")
    rss = getattr(mem, "rss", None)
    created = info.get("create_time")
    cpu, mem_pct, ppid = info.get("cpu_percent"), info.get("memory_percent"), info.get("ppid")
    return ProcessDiagnostics(
        pid=int(info["pid"]),  # type: ignore[arg-type]
        parent_pid=ppid if isinstance(ppid, int) else None,
        role=role,
        command=_command(info),
        status=str(info["status"]) if info.get("status") else None,
        cpu_percent=float(cpu) if isinstance(cpu, int | float) else None,
        memory_percent=round(float(mem_pct), 3) if isinstance(mem_pct, int | float) else None,
        rss=Memory.from_bytes(rss) if isinstance(rss, int) else None,
        elapsed_seconds=round(now - created, 1) if isinstance(created, int | float) else None,
        is_child_of_skulk=in_tree,
    )


def scan_processes(
    runner_pids: Collection[int] = (), root: int | None = None, limit: int = MAX_PROCESSES
) -> list[ProcessDiagnostics]:
    """Skulk's own tree, the node's process first, up to `limit` rows."""
    root = os.getpid() if root is None else root
    tree = _tree(root)
    now = time.time()
    rows: list[ProcessDiagnostics] = []
    for pid in sorted(tree):
        try:
            info: dict[str, object] = psutil.Process(pid).as_dict(_ATTRS, ad_value=None)
        except psutil.Error:
            continue  # gone since the tree was read
        in_tree = True
        role = classify(pid, str(info.get("name") or ""), _command(info), root, runner_pids, in_tree)
        if role is not None:
            rows.append(_row(info, role, in_tree, now))
    rows.sort(key=lambda p: (not p.is_child_of_skulk, p.pid != root, p.pid))
    return rows[:limit]
