"""How much memory a node offers a shard: its free RAM, or on a unified-memory APU the GPU's pool.

On an AMD APU (e.g. Strix Halo) the BIOS carves a VRAM region out of system RAM that the OS counters no longer
show, and the GPU reaches system RAM beyond it through GTT (seed 002, gttTotalBytes). A node that reports GTT
larger than its VRAM is such a machine: its shards can use the free carve-out plus as much free RAM as GTT
lets the GPU map. Everywhere else (discrete GPUs, Apple's working set already folded into RAM, CPU-only nodes)
free RAM is what a rank can use.
"""

from __future__ import annotations

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


def usable_bytes(state: State, node: NodeId) -> int:
    """Free bytes placement may plan a shard into on the node (the node's memory must be known)."""
    ram = state.node_memory[node].ram_available.in_bytes
    accelerator = state.node_accelerator.get(node)
    if accelerator is None or not is_unified(accelerator):
        return ram
    assert accelerator.vram_total_bytes is not None and accelerator.gtt_total_bytes is not None
    carve_out_free = max(0, accelerator.vram_total_bytes - (accelerator.vram_used_bytes or 0))
    return carve_out_free + min(ram, accelerator.gtt_total_bytes)
