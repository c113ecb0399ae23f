"""Per-rank memory arithmetic for placement: layers per rank, weight share, KV pool, the fit check.

Separate from ring choice so the numbers the 400 message quotes are computed in exactly one place.

The KV pool is sized here, at placement, so its bytes are counted before a runner ever allocates them. Every rank
of an instance holds the same number of token positions (the engines' block tables are identical on every rank),
each for its own layers (Pipeline) or heads (Tensor): pool_tokens picks that number once for the ring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from skulk.types.backends import EngineName
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.models import DType, ModelCard

RUNTIME_OVERHEAD_FACTOR = 1.25
"""Raw weight bytes grow at load time (activations, allocator slack, the runner itself)."""

DTYPE_BYTES: dict[DType, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

DEFAULT_KV_FRACTION = 0.25
"""With no kv_cache_gb (neither the placement's nor the card's), the pool takes this share of what the tightest
node of the ring has free after its weights: the same share the torch engine takes of free memory when built
outside placement (engines/torch/schedule.DEFAULT_KV_FRACTION)."""
MAX_STREAMS = 64
"""A default pool never holds more than this many requests of the whole context: the torch engine's concurrent
streams per instance (engines/torch/engine.DEFAULT_MAX_BATCH); more positions would never be used."""


# ---------------------------------------------------------------------------------------------- arithmetic


def loaded_bytes(card: ModelCard, engine: EngineName) -> int:
    """The weight bytes a rank of this engine loads for the whole model: the files for torch (which keeps a GGUF
    file's blocks), the bf16 export for an MLX rank serving a GGUF import (card.mlx_storage_size)."""
    if engine == "mlx" and card.mlx_storage_size is not None:
        return card.mlx_storage_size.in_bytes
    return card.storage_size.in_bytes


def kv_bytes_per_token(card: ModelCard, n_layers: int, tensor_ways: int = 1) -> int:
    """What one token position costs in the KV cache of `n_layers` layers (keys and values, the card's dtype).

    Tensor ranks hold 1/tensor_ways of the key/value heads, so their cache is that fraction. An embedding model
    keeps no KV cache.
    """
    if card.embeds:
        return 0
    head_dim = card.head_dim or card.hidden_size // card.num_attention_heads
    kv_heads = card.num_key_value_heads // tensor_ways
    return 2 * n_layers * kv_heads * head_dim * DTYPE_BYTES[card.dtype]


def kv_headroom_bytes(card: ModelCard, n_layers: int, tensor_ways: int = 1, context: int | None = None) -> int:
    """KV cache for one request of the whole context over `n_layers`: the least pool a placed model can serve with."""
    return kv_bytes_per_token(card, n_layers, tensor_ways) * (context or card.context_length)


def admitted_context(card: ModelCard, max_context: int | None) -> int:
    """The context an instance admits: the model's own, capped by the placement's max_context. An embedding model
    keeps its own: its encoder takes each input whole, up to its positions, and keeps no KV cache."""
    if max_context is None or card.embeds:
        return card.context_length
    return min(card.context_length, max_context)


def explicit_pool_tokens(card: ModelCard, kv_cache_bytes: int) -> int:
    """Token positions an instance-wide pool of kv_cache_bytes holds (over every layer and head)."""
    return kv_cache_bytes // max(1, kv_bytes_per_token(card, card.n_layers))


def pool_tokens(
    per_token: Sequence[int], base: Sequence[int], free: Sequence[int], context: int, kv_cache_bytes: int | None,
    full_per_token: int,
) -> int:
    """Token positions every rank's pool holds. An explicit pool (kv_cache_bytes, all ranks together) is split in
    proportion to each rank's per-token cost; the default is DEFAULT_KV_FRACTION of the tightest rank's memory left
    after its weights (`base`), at most MAX_STREAMS whole contexts, and never less than one whole context, so any
    admitted request can run (a ring too small for that is refused by the fit check, not by a smaller pool)."""
    if full_per_token == 0:
        return 0
    if kv_cache_bytes is not None:
        return kv_cache_bytes // full_per_token
    spare = min(int(DEFAULT_KV_FRACTION * max(0, f - b)) // max(1, p) for p, b, f in zip(per_token, base, free,
                                                                                       strict=True))
    return max(context, min(spare, MAX_STREAMS * context))


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
    kv_pool: int
    free: int
    draft: int = 0
    """A draft model's weights (with their overhead) and its KV for the pool's positions: rank 0 of a single-rank
    torch instance whose card names one (the engine's draft cache has the target's blocks)."""

    @property
    def base(self) -> int:
        """The weights with their runtime overhead: what the rank needs before any KV."""
        return weights_base(self.weights_share)

    @property
    def needed(self) -> int:
        return self.base + self.kv_pool + self.draft

    @property
    def left_after(self) -> int:
        return self.free - self.needed

    @property
    def fits(self) -> bool:
        # Strictly less: a model exactly the size of free memory would thrash rather than run.
        return self.needed < self.free


def draft_committed(draft: ModelCard, kv_pool: int, target_per_token: int, loaded: bool) -> int:
    """What a draft model beside a single torch rank commits on its node: its KV for the positions of the target's
    pool (kv_pool bytes at target_per_token), and its weights until the runner has loaded (then they are in the
    node's reading, as the target's are)."""
    kv = kv_pool // max(1, target_per_token) * kv_bytes_per_token(draft, draft.n_layers)
    return kv if loaded else kv + loaded_bytes(draft, "torch")


def weights_base(weights_share: int) -> int:
    return math.ceil(weights_share * RUNTIME_OVERHEAD_FACTOR)


def plan_ring(
    card: ModelCard, sharding: Sharding, ring: Sequence[NodeId], free: list[int], *, context: int | None = None,
    kv_cache_bytes: int | None = None, engines: Sequence[EngineName] | None = None, draft: ModelCard | None = None,
) -> tuple[NodePlan, ...]:
    """Each rank's layers and bytes: Tensor splits weights evenly, Pipeline in proportion to what each rank can
    hold (free memory over the bytes its engine loads: loaded_bytes); every rank's KV pool holds the same
    pool_tokens positions of its own layers (Pipeline) or heads (Tensor).
    context: what the instance admits (admitted_context; None: the model's own). engines: each rank's (None: torch).
    draft: the card's draft model, counted on a single torch rank (the only one that speculates)."""
    size = len(ring)
    default: list[EngineName] = ["torch"] * size
    weights = [loaded_bytes(card, e) for e in (engines or default)]
    if sharding == Sharding.Tensor:
        ranges = [(0, card.n_layers)] * size
        shares = [-(-w // size) for w in weights]
        per_token = [kv_bytes_per_token(card, card.n_layers, size)] * size
    else:
        most = max(weights)
        ranges = layer_ranges(allocate_layers(card.n_layers, [f * most // max(1, w) for f, w in zip(free, weights,
                                                                                                     strict=True)]))
        shares = [-(-w * (end - start) // card.n_layers) for w, (start, end) in zip(weights, ranges, strict=True)]
        per_token = [kv_bytes_per_token(card, end - start) for start, end in ranges]
    tokens = pool_tokens(per_token, [weights_base(s) for s in shares], free, context or card.context_length,
                         kv_cache_bytes, kv_bytes_per_token(card, card.n_layers))
    plans = tuple(
        NodePlan(node_id=n, start_layer=start, end_layer=end, weights_share=share, kv_pool=tokens * p, free=f)
        for n, (start, end), share, p, f in zip(ring, ranges, shares, per_token, free, strict=True)
    )
    if draft is not None and size == 1 and (engines or default)[0] == "torch":
        extra = weights_base(loaded_bytes(draft, "torch")) + tokens * kv_bytes_per_token(draft, draft.n_layers)
        plans = (replace(plans[0], draft=extra),)
    return plans
