"""GTT memory on unified-memory machines (seed 002): read from amdgpu's sysfs files (a fake sysfs root here)
and counted by placement on a node whose GTT is larger than its VRAM carve-out."""

from __future__ import annotations

from pathlib import Path

from skulk.master.memory_pool import is_unified, usable_bytes
from skulk.master.placement import place
from skulk.types.ids import InstanceId, NodeId, RunnerId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import Memory
from skulk.types.node_info import AcceleratorInfo, MemoryUsage, Topology
from skulk.types.state import State
from skulk.worker.node_info import amd_accelerator

from .factories import CARD

GIB = 1 << 30


def fake_card(root: Path, name: str, files: dict[str, str]) -> None:
    device = root / "class" / "drm" / name / "device"
    device.mkdir(parents=True)
    for key, value in files.items():
        (device / key).write_text(value + "\n")


def test_an_apu_reports_vram_and_gtt_from_sysfs(tmp_path: Path) -> None:
    fake_card(tmp_path, "card0", {"vendor": "0x8086"})  # an Intel iGPU: not amdgpu
    fake_card(tmp_path, "card1", {
        "vendor": "0x1002", "mem_info_vram_total": str(512 << 20), "mem_info_vram_used": str(100 << 20),
        "mem_info_gtt_total": str(96 * GIB), "gpu_busy_percent": "7", "product_name": "Strix Halo",
    })
    info = amd_accelerator(tmp_path)
    assert info is not None
    assert (info.vendor, info.name, info.vram_total_bytes, info.vram_used_bytes, info.gtt_total_bytes) == (
        "amd", "Strix Halo", 512 << 20, 100 << 20, 96 * GIB)
    assert info.utilization_ratio == 0.07 and is_unified(info)
    assert info.model_dump(by_alias=True)["gttTotalBytes"] == 96 * GIB


def test_no_amdgpu_card_reports_nothing(tmp_path: Path) -> None:
    assert amd_accelerator(tmp_path) is None
    fake_card(tmp_path, "card0", {"vendor": "0x10de", "mem_info_vram_total": "1"})
    assert amd_accelerator(tmp_path) is None


def test_a_discrete_gpu_is_not_unified() -> None:
    assert not is_unified(AcceleratorInfo(vendor="amd", vram_total_bytes=24 * GIB, gtt_total_bytes=16 * GIB))
    assert not is_unified(AcceleratorInfo(vendor="cpu"))


def one_node(accelerator: AcceleratorInfo | None) -> State:
    node = NodeId("apu")
    return State(
        topology=Topology(nodes=[node]),
        node_memory={node: MemoryUsage(ram_total=Memory.from_gb(2), ram_available=Memory.from_bytes(GIB // 2))},
        node_accelerator={node: accelerator} if accelerator else {},
    )


def test_placement_counts_the_gpu_pool_of_a_unified_memory_node() -> None:
    """Free RAM alone (0.5 GiB) cannot hold the 1 GiB model; the free 4 GiB carve-out plus the RAM that GTT
    maps can."""
    apu = AcceleratorInfo(vendor="amd", vram_total_bytes=4 * GIB, vram_used_bytes=0, gtt_total_bytes=16 * GIB)
    assert usable_bytes(one_node(apu), NodeId("apu")) == 4 * GIB + GIB // 2
    assert usable_bytes(one_node(None), NodeId("apu")) == GIB // 2
    ids = iter(range(10))

    def attempt(state: State) -> object:
        return place(state, CARD, Sharding.Pipeline, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                     new_runner_id=lambda: RunnerId(f"r{next(ids)}"), rendezvous_port=29500)

    assert not isinstance(attempt(one_node(None)), MlxRingInstance)
    assert isinstance(attempt(one_node(apu)), MlxRingInstance)
