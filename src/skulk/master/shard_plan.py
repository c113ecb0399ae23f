"""Per-rank memory arithmetic for placement: layers per rank, weight share, KV headroom, the fit check.

Separate from ring choice so the numbers the 400 message quotes are computed in exactly one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.models import DType, ModelCard

RUNTIME_OVERHEAD_FACTOR = 1.25
"""Raw weight bytes grow at load time (activations, allocator slack, the runner itself)."""

DTYPE_BYTES: dict[DType, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------------------------- arithmetic


def kv_headroom_bytes(card: ModelCard, n_layers: int, tensor_ways: int = 1) -> int:
    """KV cache for one full-context sequence over `n_layers`, so a placed model can serve a request.

    Tensor ranks hold 1/tensor_ways of the key/value heads, so their cache is that fraction.
    """
    head_dim = card.head_dim or card.hidden_size // card.num_attention_heads
    kv_heads = card.num_key_value_heads // tensor_ways
    return 2 * n_layers * kv_heads * head_dim * card.context_length * DTYPE_BYTES[card.dtype]


def allocate_layers(n_layers: int, free_bytes: Sequence[int]) -> list[int]:
    """Layers per rank in proportion to free memory (largest remainder), every rank at least one.

    Integer arithmetic only, ties to the lower rank, so every node computes the same split.
    """
    count = len(free_bytes)
    if count == 0 or n_layers < count:
        raise ValueError(f"cannot give {count} ranks at least one of {n_layers} layers")
    total = sum(max(f, 0) for f in free_bytes)
    weights = [max(f, 0) for f in free_bytes] if total > 0 else [1] * count
    total = sum(weights)
    layers = [n_layers * w // total for w in weights]
    by_remainder = sorted(range(count), key=lambda i: (-(n_layers * weights[i] % total), i))
    for i in by_remainder[: n_layers - sum(layers)]:
        layers[i] += 1
    for i in range(count):
        if layers[i] == 0:
            donor = max(range(count), key=lambda j: (layers[j], -j))
            layers[donor] -= 1
            layers[i] = 1
    return layers


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous [start, end) per rank, in rank order, covering every layer once."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class NodePlan:
    """One rank's layers and the memory arithmetic behind its yes or no."""

    node_id: NodeId
    start_layer: int
    end_layer: int
    weights_share: int
    kv_headroom: int
    free: int

    @property
    def needed(self) -> int:
        return math.ceil(self.weights_share * RUNTIME_OVERHEAD_FACTOR) + self.kv_headroom

    @property
    def left_after(self) -> int:
        return self.free - self.needed

    @property
    def fits(self) -> bool:
        # Strictly less: a model exactly the size of free memory would thrash rather than run.
        return self.needed < self.free


def plan_ring(
    card: ModelCard, sharding: Sharding, ring: Sequence[NodeId], free: list[int]
) -> tuple[NodePlan, ...]:
    """Each rank's layers and bytes: Tensor splits weights evenly, Pipeline in proportion to free memory."""
    weights, size = card.storage_size.in_bytes, len(ring)
    if sharding == Sharding.Tensor:
        share, kv = -(-weights // size), kv_headroom_bytes(card, card.n_layers, size)
        return tuple(NodePlan(n, 0, card.n_layers, share, kv, f) for n, f in zip(ring, free, strict=True))
    ranges = layer_ranges(allocate_layers(card.n_layers, free))
    return tuple(
        NodePlan(
            node_id=n,
            start_layer=start,
            end_layer=end,
            weights_share=-(-weights * (end - start) // card.n_layers),
            kv_headroom=kv_headroom_bytes(card, end - start),
            free=f,
        )
        for n, (start, end), f in zip(ring, ranges, free, strict=True)
    )
