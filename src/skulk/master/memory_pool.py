"""How much memory a node offers a shard: its free RAM, or on a unified-memory APU the GPU's pool.

On an AMD APU (e.g. Strix Halo) the BIOS carves a VRAM region out of system RAM that the OS counters no longer
show, and the GPU reaches system RAM beyond it through GTT (seed 002, gttTotalBytes). A node that reports GTT
larger than its VRAM is such a machine: its shards can use the free carve-out plus as much free RAM as GTT
lets the GPU map. A node with an NVIDIA GPU that advertises torch-cuda runs its torch ranks on the GPU: such a
rank can use the GPU's free memory. Everywhere else (Apple's working set already folded into RAM, CPU-only nodes,
an MLX rank) free RAM is what a rank can use.
"""

from __future__ import annotations

from skulk.types.backends import BackendTag, EngineName
from skulk.types.ids import NodeId
from skulk.types.node_info import AcceleratorInfo
from skulk.types.state import State


def is_unified(accelerator: AcceleratorInfo | None) -> bool:
    """GTT reported and larger than the VRAM carve-out: the GPU's pool is mostly system RAM."""
    return (
        accelerator is not None
        and accelerator.gtt_total_bytes is not None
        and accelerator.vram_total_bytes is not None
        and accelerator.gtt_total_bytes > accelerator.vram_total_bytes
    )


def gpu_free_bytes(backends: list[BackendTag], accelerator: AcceleratorInfo | None) -> int | None:
    """Free device memory of a node whose torch ranks compute on its NVIDIA GPU (it advertises torch-cuda and
    reports the GPU's memory, worker/node_info.py); None elsewhere."""
    if ("torch-cuda" not in backends or accelerator is None or accelerator.vendor != "nvidia"
            or accelerator.vram_total_bytes is None):
        return None
    return max(0, accelerator.vram_total_bytes - (accelerator.vram_used_bytes or 0))


def usable_bytes(state: State, node: NodeId, engine: EngineName | None = None) -> int:
    """Free bytes placement may plan a shard into on the node (the node's memory must be known): for a torch rank
    on a CUDA node the GPU's free memory (its weights and KV live there), else RAM (or the UMA pool)."""
    ram = state.node_memory[node].ram_available.in_bytes
    accelerator = state.node_accelerator.get(node)
    if engine == "torch" and (gpu := gpu_free_bytes(state.node_backends.get(node, []), accelerator)) is not None:
        return gpu
    if accelerator is None or not is_unified(accelerator):
        return ram
    assert accelerator.vram_total_bytes is not None and accelerator.gtt_total_bytes is not None
    carve_out_free = max(0, accelerator.vram_total_bytes - (accelerator.vram_used_bytes or 0))
    return carve_out_free + min(ram, accelerator.gtt_total_bytes)
