"""Resource readings for the node bundle: what the state last gathered beside what this process reads now.

The two can differ on purpose: a gap between gathered and current free memory says the placement decision
saw a different machine than the one that is running now. Blocking (psutil, NVML, vm_stat): off the loop.
"""

from __future__ import annotations

import re
import subprocess
import sys

from skulk import memory_limit
from skulk.types.diagnostics_bundle import ResourceDiagnostics, SystemDiagnostics
from skulk.types.ids import NodeId
from skulk.types.memory import Memory
from skulk.types.node_info import MemoryUsage
from skulk.types.state import State
from skulk.worker import node_info

_PAGE_SIZE = re.compile(r"page size of (\d+) bytes")
_WIRED = re.compile(r"Pages wired down:\s+(\d+)")


def current_wired() -> Memory | None:
    """macOS only: wired (unpageable) memory, to spot memory leaked by an abnormal Metal termination."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=1, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    page, wired = _PAGE_SIZE.search(out), _WIRED.search(out)
    if page is None or wired is None:
        return None
    return Memory.from_bytes(int(page.group(1)) * int(wired.group(1)))


def _current_memory(limit: str | None, reserve: str) -> MemoryUsage | None:
    try:
        return node_info.memory(limit, reserve)
    except Exception:
        return None


def gather_resources(state: State, node_id: NodeId, limit: str | None = None,
                     reserve: str = memory_limit.DEFAULT_RESERVE) -> ResourceDiagnostics:
    """Event-sourced readings come from state; the accelerator is read live if it was never gossiped."""
    accelerator = state.node_accelerator.get(node_id) or node_info.accelerator()
    perf = state.node_system.get(node_id)
    system = SystemDiagnostics(**(perf.model_dump(by_alias=False) if perf else {}), accelerator=accelerator)
    return ResourceDiagnostics(
        gathered_memory=state.node_memory.get(node_id),
        current_memory=_current_memory(limit, reserve),
        current_wired=current_wired(),
        disk=state.node_disk.get(node_id),
        system=system,
        accelerator=accelerator,
        network=state.node_network.get(node_id),
    )
