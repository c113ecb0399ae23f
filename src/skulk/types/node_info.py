"""What a node says about itself: identity, memory, disk, interfaces, accelerator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .backends import BackendTag, EngineName
from .base import CamelModel
from .ids import NodeId
from .links import DecodeCompute, LinkMeasurement
from .memory import Memory


class NodeIdentity(CamelModel):
    model_id: str = "Unknown"
    chip_id: str = "Unknown"
    friendly_name: str = "Unknown"
    os_version: str = "Unknown"
    os_build_version: str = "Unknown"
    skulk_version: str = "Unknown"
    skulk_commit: str = "Unknown"


PAGING_FAULTS_PER_S = 20.0
"""Major faults a second, over 30 s, that read as paging: a node whose weights fit takes none once loaded (a
1B model over a 2.5 GB limit took about 46 a second, at a tenth of its speed)."""


RankRole = Literal["first", "later"]
"""A runner's place in its instance, as its memory differs: the first rank (or a single one) holds the tokenizer,
the grammar compiler and the chat template's machinery besides its shard; a later rank only its layers and link
(measured on the 2-core VM: 433-436 MiB against 339-340 MiB beside the same shards)."""


def rank_role(device_rank: int) -> RankRole:
    return "first" if device_rank == 0 else "later"


class RunnerOverhead(CamelModel):
    """What this node's runners of one engine and role held resident besides their weights and KV pool, once
    warm: measured by the runner itself (its RSS after warm-up less the weight bytes it holds and the KV pages it
    zeroed), the latest load's figure. Placement counts it for this node's ranks (engines/footprint.py's default
    until a runner has measured one)."""

    engine: EngineName
    role: RankRole
    overhead: Memory


class MemoryUsage(CamelModel):
    ram_total: Memory
    """The node's memory limit: the smallest of the machine's RAM, its cgroup's limit, a Mac's GPU working set and
    --memory-limit (memory_limit.py); `limit_source` says which."""
    ram_available: Memory
    """Free under that limit, less the reserve: what placement plans shards and KV pools into."""
    swap_total: Memory = Memory()
    swap_available: Memory = Memory()
    ram_used: Memory | None = None
    """What is counted as used against the limit (the group's usage less reclaimable page cache, the machine's
    used memory, or Skulk's own processes under an operator's --memory-limit)."""
    ram_reserved: Memory | None = None
    """Kept back from placement (--memory-reserve)."""
    limit_source: str | None = None
    """Where the limit came from: machine, cgroup v1, cgroup v2, gpu working set or --memory-limit."""
    major_faults_per_s: float | None = None
    """Pages the node and its runners read back from disk a second, over the last 30 s: weights that do not fit
    the limit are evicted and read again every step (health says `memory_paging`)."""
    oom_kills: int | None = None
    """OOM kills in the node's cgroup (or on its machine) over the last 10 minutes (health says `memory_oom`)."""
    runner_overheads: list[RunnerOverhead] | None = Field(default=None, exclude_if=lambda v: v is None)
    """The runtime overhead this node's runners measured, per engine and role (None: none has loaded yet, and
    the key is left out: a node of format version 1, which forbids unknown keys, still reads this node's info
    until one of its runners has loaded; after that it drops them until it is upgraded)."""

    def runner_overhead(self, engine: EngineName, role: RankRole) -> int | None:
        """The measured runtime bytes of a runner of `engine` in `role` on this node, if one has measured it; a
        later rank not yet measured counts the first rank's figure, which bounds it (it has no grammar compiler
        and templates to hold)."""
        found = {o.role: o.overhead.in_bytes for o in self.runner_overheads or () if o.engine == engine}
        return found.get(role, found.get("first"))

    @property
    def paging(self) -> bool:
        """Reading pages back from disk steadily: a served model that does not fit (a load's one pass reads its
        file once; health ignores a node whose runners are loading)."""
        return (self.major_faults_per_s or 0.0) >= PAGING_FAULTS_PER_S


class DiskUsage(CamelModel):
    total: Memory
    available: Memory


class SystemPerformance(CamelModel):
    gpu_usage: float = 0.0
    temp: float = 0.0
    sys_power: float = 0.0
    pcpu_usage: float = 0.0
    ecpu_usage: float = 0.0


AcceleratorVendor = Literal["apple", "amd", "nvidia", "intel", "cpu", "unknown"]


class AcceleratorInfo(CamelModel):
    vendor: AcceleratorVendor = "unknown"
    name: str = "Unknown"
    utilization_ratio: float | None = None
    vram_total_bytes: int | None = None
    vram_used_bytes: int | None = None
    gtt_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    clock_mhz: int | None = None


InterfaceType = Literal["wifi", "ethernet", "maybe_ethernet", "thunderbolt", "unknown"]


class NetworkInterface(CamelModel):
    name: str
    ip_address: str
    interface_type: InterfaceType = "unknown"


class NetworkInfo(CamelModel):
    interfaces: list[NetworkInterface] = []


class NodeInfo(CamelModel):
    """One gathering of everything a node reports; fields it could not read are None."""

    identity: NodeIdentity | None = None
    memory: MemoryUsage | None = None
    disk: DiskUsage | None = None
    system: SystemPerformance | None = None
    accelerator: AcceleratorInfo | None = None
    network: NetworkInfo | None = None
    api_port: int | None = None
    backends: list[BackendTag] | None = None
    """Every backend tag this node can run, the bare engine tags included (types/backends.py)."""
    links: dict[NodeId, LinkMeasurement] | None = None
    """Round trip and bandwidth this node measured to each peer it reaches (worker/links.py)."""
    compute: DecodeCompute | None = None
    """This node's decode speed, learned from the requests it served (worker/compute.py); None until it served."""


class Connection(CamelModel):
    """source can reach sink at sink_address over source's interface."""

    source: NodeId
    sink: NodeId
    sink_address: str
    interface: str | None = None


class Topology(CamelModel):
    nodes: list[NodeId] = []
    connections: list[Connection] = []
