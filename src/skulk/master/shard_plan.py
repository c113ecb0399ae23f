"""Per-rank memory arithmetic for placement: layers per rank, weight share, KV pool, the fit check.

Separate from ring choice so the numbers the 400 message quotes are computed in exactly one place.

The KV pool is sized here, at placement, so its bytes are counted before a runner ever allocates them. Every rank
of an instance holds the same number of token positions (the engines' block tables are identical on every rank),
each for its own layers (Pipeline) or heads (Tensor): pool_tokens picks that number once for the ring. A hybrid
model (Gemma 3: sliding-window layers beside global ones) keeps its sliding layers in a second pool that holds only
what their windows see (engines/kv_pools.py): a rank's pool is its global layers' bytes for those positions plus its
sliding layers' for local_tokens of them, the split the engine makes of the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES, SHARD_SLACK, planned_base
from skulk.engines.kv_pools import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_FRACTION,
    DEFAULT_PREFILL_CHUNK,
    hybrid_window,
    kv_head_bytes,
    local_pool_blocks,
    split_pool,
)
from skulk.master.balance import balanced_layers, decode_bytes, memory_costs, steps_toward
from skulk.types.backends import EngineName
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.model_memory import LayerMemory
from skulk.types.models import DType, ModelCard

DTYPE_BYTES: dict[DType, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

MAX_STREAMS = 64
"""A default pool never holds more than this many requests of the whole context: the torch engine's concurrent
streams per instance (engines/torch/engine.DEFAULT_MAX_BATCH); more positions would never be used."""


# ---------------------------------------------------------------------------------------------- arithmetic


def loaded_bytes(card: ModelCard, engine: EngineName) -> int:
    """The weight bytes a rank of this engine loads for the whole model: the files for torch (which keeps a GGUF
    file's blocks) but for MXFP4 experts it dequantizes (card.torch_storage_size), the bf16 export for an MLX rank
    serving a GGUF import (card.mlx_storage_size)."""
    if engine == "mlx" and card.mlx_storage_size is not None:
        return card.mlx_storage_size.in_bytes
    if engine == "torch" and card.torch_storage_size is not None:
        return card.torch_storage_size.in_bytes
    return card.storage_size.in_bytes


def kv_bytes_per_token(card: ModelCard, n_layers: int, tensor_ways: int = 1) -> int:
    """What one token position costs in the KV cache of `n_layers` layers (keys and values, in the card's dtype, or
    at its kv_cache_bits: kv_pools.kv_head_bytes, the rule the engine's pools follow).

    Tensor ranks hold 1/tensor_ways of the key/value heads, so their cache is that fraction. An embedding model
    keeps no KV cache.
    """
    if card.embeds:
        return 0
    head_dim = card.head_dim or card.hidden_size // card.num_attention_heads
    kv_heads = card.num_key_value_heads // tensor_ways
    return 2 * n_layers * kv_heads * kv_head_bytes(head_dim, card.kv_cache_bits or 16, DTYPE_BYTES[card.dtype])


def layer_kv_bytes(card: ModelCard, layer: LayerMemory, tensor_ways: int = 1, engine: EngineName | None = None
                   ) -> int:
    """What one position costs one layer of a card with per-layer memory (ModelCard.memory): keys and values of
    its KV heads (a tensor rank's share of them), or MLA's one latent, whole on every rank; nothing for a layer
    that keeps a state instead (stream_state_bytes) or no cache at all. engine "torch": what that engine caches
    where it differs (LayerMemory.torch_kv_heads: its native MLA's expanded heads); None: the layer's own figure."""
    if card.embeds or layer.kv_heads == 0:
        return 0
    if engine == "torch" and layer.torch_kv_heads:
        head = kv_head_bytes(layer.torch_head_dim, card.kv_cache_bits or 16, DTYPE_BYTES[card.dtype])
        return 2 * (layer.torch_kv_heads // tensor_ways) * head
    head = kv_head_bytes(layer.head_dim, card.kv_cache_bits or 16, DTYPE_BYTES[card.dtype])
    return head if layer.latent else 2 * (layer.kv_heads // tensor_ways) * head


def stream_state_bytes(card: ModelCard, start: int, end: int, tensor_ways: int = 1,
                       engine: EngineName | None = None) -> int:
    """The constant state one stream keeps in layers [start, end): linear attention's and SSMs' (its heads split
    among tensor ranks); 0 for a card without per-layer memory. engine "torch": what that engine holds where it
    holds more (LayerMemory.torch_state_bytes: two float32 slots a stream); None: the layer's own figure."""
    if card.memory is None or card.embeds:
        return 0
    torch = engine == "torch"
    return sum((layer.torch_state_bytes if torch and layer.torch_state_bytes else layer.state_bytes)
               for layer in card.memory.layers[start:end]) // tensor_ways


def kv_headroom_bytes(card: ModelCard, n_layers: int, tensor_ways: int = 1, context: int | None = None,
                      engine: EngineName | None = None) -> int:
    """KV cache for one request of the whole context over `n_layers`: the least pool a placed model can serve with
    (engine: where it caches differently, layer_kv_bytes)."""
    return pool_bytes(card, 0, n_layers, context or card.context_length, tensor_ways, engine=engine)


def _windowed(card: ModelCard) -> tuple[int | None, list[bool]]:
    """The window and which layers it bounds: ModelCard.memory's sliding and chunked layers (the widest window
    where they differ: a bound for each), else sliding_window and sliding_layers."""
    if card.memory is not None:
        windows = [layer.window for layer in card.memory.layers if layer.kv_heads]
        bounded = [layer.kv_heads > 0 and layer.window is not None for layer in card.memory.layers]
        return max((w for w in windows if w is not None), default=None), bounded
    sliding = set(card.sliding_layers)
    return card.sliding_window, [i in sliding for i in range(card.n_layers)]


def local_window(card: ModelCard) -> int:
    """The window of a hybrid model's sliding layer group (engines/kv_pools.py); 0 for a model of one group."""
    window, bounded = _windowed(card)
    return hybrid_window(window, bounded)


def group_bytes_per_token(card: ModelCard, start: int, end: int, tensor_ways: int = 1,
                          engine: EngineName | None = None) -> tuple[int, int]:
    """What one position costs a rank holding layers [start, end) in its (global, sliding) pools: every layer in the
    first for a model of one group. engine: the rank's (layer_kv_bytes)."""
    if card.memory is not None:
        hybrid = local_window(card) > 0
        full = local = 0
        for layer in card.memory.layers[start:end]:
            cost = layer_kv_bytes(card, layer, tensor_ways, engine)
            if hybrid and layer.window is not None:
                local += cost
            else:
                full += cost
        return full, local
    sliding = sum(1 for i in card.sliding_layers if start <= i < end) if local_window(card) else 0
    return kv_bytes_per_token(card, end - start - sliding, tensor_ways), kv_bytes_per_token(card, sliding, tensor_ways)


def local_cap(card: ModelCard) -> int:
    """The most positions a hybrid model's sliding pool holds: what MAX_STREAMS requests' windows see at the torch
    engine's block size and prefill chunk (kv_pools.local_pool_blocks); 0 for a model of one group."""
    window = local_window(card)
    blocks = local_pool_blocks(window, DEFAULT_BLOCK_SIZE, MAX_STREAMS, DEFAULT_PREFILL_CHUNK) if window else 0
    return blocks * DEFAULT_BLOCK_SIZE


def pool_bytes(card: ModelCard, start: int, end: int, tokens: int, tensor_ways: int = 1, streams: int = 1,
               engine: EngineName | None = None) -> int:
    """A rank's pool of `tokens` positions for layers [start, end): a hybrid model's sliding layers hold at most
    local_cap of them; and the constant state of `streams` streams in its linear-attention and SSM layers."""
    full, local = group_bytes_per_token(card, start, end, tensor_ways, engine)
    states = streams * stream_state_bytes(card, start, end, tensor_ways, engine)
    return tokens * full + min(tokens, local_cap(card)) * local + states


def tokens_for(kv_bytes: int, per_token: tuple[int, int], cap: int, most: int) -> int:
    """Positions a pool of kv_bytes holds at per_token (global, sliding) bytes a position (pool_bytes' inverse)."""
    return split_pool(kv_bytes, per_token[0], per_token[1], cap, most)[0]


def admitted_context(card: ModelCard, max_context: int | None) -> int:
    """The context an instance admits: the model's own, capped by the placement's max_context. An embedding model
    keeps its own: its encoder takes each input whole, up to its positions, and keeps no KV cache."""
    if max_context is None or card.embeds:
        return card.context_length
    return min(card.context_length, max_context)


def explicit_pool_tokens(card: ModelCard, kv_cache_bytes: int, engine: EngineName | None = None) -> int:
    """Token positions an instance-wide pool of kv_cache_bytes holds (over every layer and head) on `engine`'s
    ranks (None: the card's own figure, layer_kv_bytes)."""
    if card.embeds:
        return 0
    kv_cache_bytes = max(0, kv_cache_bytes - MAX_STREAMS * stream_state_bytes(card, 0, card.n_layers, engine=engine))
    per_token = group_bytes_per_token(card, 0, card.n_layers, engine=engine)
    return tokens_for(kv_cache_bytes, per_token, local_cap(card), _UNBOUNDED)


_UNBOUNDED = 1 << 62


def pool_tokens(
    per_token: Sequence[tuple[int, int]], base: Sequence[int], free: Sequence[int], context: int,
    kv_cache_bytes: int | None, full_per_token: tuple[int, int], cap: int = 0,
) -> int:
    """Token positions every rank's pool holds. An explicit pool (kv_cache_bytes, all ranks together) is split in
    proportion to each rank's per-token cost; the default is DEFAULT_KV_FRACTION of the tightest rank's memory left
    after its weights (`base`), at most MAX_STREAMS whole contexts, and never less than one whole context, so any
    admitted request can run (a ring too small for that is refused by the fit check, not by a smaller pool).
    per_token: each rank's (global, sliding) bytes a position; cap: local_cap (0: one group)."""
    if sum(full_per_token) == 0:
        return 0
    if kv_cache_bytes is not None:
        return tokens_for(kv_cache_bytes, full_per_token, cap, _UNBOUNDED)
    most = MAX_STREAMS * context
    spare = min(tokens_for(int(DEFAULT_KV_FRACTION * max(0, f - b)), p, cap, most)
                for p, b, f in zip(per_token, base, free, strict=True))
    return max(context, min(spare, most))


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
    exact: bool = False
    """weights_share is the rank's real bytes, layer by layer (ModelCard.memory), not the files' bytes in
    proportion to its layers (an estimate, counted x SHARD_SLACK: engines/footprint.planned_base)."""
    runtime: int | None = None
    """The runner's runtime overhead on this node, as its runners measured it (None: not yet, and
    RUNTIME_OVERHEAD_BYTES is counted)."""
    draft: int = 0
    """A draft model's weights (with their overhead) and its KV for the pool's positions: rank 0 of a single-rank
    torch instance whose card names one (the engine's draft cache has the target's blocks)."""

    @property
    def base(self) -> int:
        """The weights with the runner's runtime: what the rank needs before any KV (engines/footprint.
        planned_base)."""
        return planned_base(self.weights_share, self.runtime, self.exact)

    @property
    def runtime_bytes(self) -> int:
        """The runtime overhead counted for this rank (measured, or the default)."""
        return RUNTIME_OVERHEAD_BYTES if self.runtime is None else self.runtime

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


def draft_committed(draft: ModelCard, kv_pool: int, target: ModelCard, loaded: bool) -> int:
    """What a draft model beside a single torch rank commits on its node: its KV for the positions of the target's
    pool (kv_pool bytes of the whole target: explicit_pool_tokens), and its weights until the runner has loaded
    (then they are in the node's reading, as the target's are)."""
    kv = explicit_pool_tokens(target, kv_pool) * kv_bytes_per_token(draft, draft.n_layers)
    return kv if loaded else kv + loaded_bytes(draft, "torch")


def draft_weights(draft: ModelCard) -> int:
    """A draft model's weights in its target's runner: the same slack, no second runtime (one process)."""
    return math.ceil(SHARD_SLACK * loaded_bytes(draft, "torch"))


def exact_weights(card: ModelCard, engines: Sequence[EngineName]) -> bool:
    """Whether every rank loads the weights ModelCard.memory counts: the files as they are (no quantizing at
    load, no MLX rank reading a GGUF import's float export, no torch rank dequantizing MXFP4 experts)."""
    return card.memory is not None and card.quantize_at_load is None and not (
        card.mlx_storage_size is not None and "mlx" in engines) and not (
        card.torch_storage_size is not None and "torch" in engines)


def rank_weights(card: ModelCard, start: int, end: int) -> int:
    """A rank's real weight bytes for layers [start, end) (ModelCard.memory: its layers, the embedding on the
    first rank, the head on the last)."""
    assert card.memory is not None
    return card.memory.rank_weight_bytes(start, end)


def plan_ring(
    card: ModelCard, sharding: Sharding, ring: Sequence[NodeId], free: list[int], *, context: int | None = None,
    kv_cache_bytes: int | None = None, engines: Sequence[EngineName] | None = None, draft: ModelCard | None = None,
    costs: Sequence[int] | None = None, runtimes: Sequence[int | None] | None = None,
) -> tuple[NodePlan, ...]:
    """Each rank's layers and bytes: Tensor splits weights evenly, Pipeline in proportion to what each rank can
    hold (free memory less the runtime, over the bytes its engine loads: loaded_bytes), then moved toward the
    split that balances each rank's decode work (balance.balanced_layers: the head on the last rank; costs, each
    node's per-byte cost from balance.speed_costs, None: speeds in proportion to what each holds,
    balance.memory_costs) as far as every rank still fits; every rank's KV pool holds the same pool_tokens
    positions of its own layers (Pipeline) or heads (Tensor).
    context: what the instance admits (admitted_context; None: the model's own). engines: each rank's (None: torch).
    draft: the card's draft model, counted on a single torch rank (the only one that speculates). runtimes: each
    rank's runtime overhead as its node measured it (None, or a None in it: RUNTIME_OVERHEAD_BYTES)."""
    size = len(ring)
    runtimes = list(runtimes) if runtimes is not None else [None] * size
    default: list[EngineName] = ["torch"] * size
    exact = exact_weights(card, engines or default)
    weights = [rank_weights(card, 0, card.n_layers) if exact else loaded_bytes(card, e) for e in engines or default]
    if sharding == Sharding.Tensor:
        return _plans(card, ring, free, [(0, card.n_layers)] * size, [-(-w // size) for w in weights], size,
                      context, kv_cache_bytes, engines, draft, exact, runtimes)
    most = max(weights)
    # What each rank can give its layers: free memory less the runner every rank pays once, whatever it holds.
    capacity = [max(0, f - (RUNTIME_OVERHEAD_BYTES if r is None else r)) * most // max(1, w)
                for f, w, r in zip(free, weights, runtimes, strict=True)]
    by_memory = allocate_layers(card.n_layers, capacity)

    def plan(counts: Sequence[int]) -> tuple[NodePlan, ...]:
        ranges = layer_ranges(counts)
        shares = [rank_weights(card, start, end) if exact else -(-w * (end - start) // card.n_layers)
                  for w, (start, end) in zip(weights, ranges, strict=True)]
        return _plans(card, ring, free, ranges, shares, 1, context, kv_cache_bytes, engines, draft, exact, runtimes)

    best, work = plan(by_memory), decode_bytes(card)
    if size < 2 or work.head == 0 or not all(p.fits for p in best):
        return best  # no head to weigh, or tight memory: the memory split, and its 400 arithmetic, as they were
    goal = balanced_layers(card.n_layers, work, costs or memory_costs(capacity))
    for counts in steps_toward(by_memory, goal):
        nearer = plan(counts)
        if not all(p.fits for p in nearer):
            break
        best = nearer
    return best


def _plans(
    card: ModelCard, ring: Sequence[NodeId], free: list[int], ranges: Sequence[tuple[int, int]],
    shares: Sequence[int], ways: int, context: int | None, kv_cache_bytes: int | None,
    engines: Sequence[EngineName] | None, draft: ModelCard | None, exact: bool = False,
    runtimes: Sequence[int | None] | None = None,
) -> tuple[NodePlan, ...]:
    """The ring's plans for these ranges and weight shares: the KV pool's positions and each rank's bytes, its
    linear-attention and SSM layers' states for MAX_STREAMS streams beside them (counted first, like weights)."""
    ranks: list[EngineName] = list(engines) if engines else ["torch"] * len(ring)
    per_token = [group_bytes_per_token(card, start, end, ways, e)
                 for (start, end), e in zip(ranges, ranks, strict=True)]
    whole = ranks[0] if len(set(ranks)) == 1 else None  # an explicit pool's split: mixed engines keep the card's
    states = [MAX_STREAMS * stream_state_bytes(card, start, end, ways, e) for (start, end), e in zip(ranges, ranks,
                                                                                                      strict=True)]
    runtimes = list(runtimes) if runtimes is not None else [None] * len(ring)
    bases = [planned_base(s, r, exact) + st for s, r, st in zip(shares, runtimes, states, strict=True)]
    if kv_cache_bytes is not None:
        kv_cache_bytes = max(0, kv_cache_bytes - MAX_STREAMS * stream_state_bytes(card, 0, card.n_layers, engine=whole))
    tokens = pool_tokens(per_token, bases, free, context or card.context_length,
                         kv_cache_bytes, group_bytes_per_token(card, 0, card.n_layers, engine=whole), local_cap(card))
    plans = tuple(
        NodePlan(node_id=n, start_layer=start, end_layer=end, weights_share=share,
                 kv_pool=pool_bytes(card, start, end, tokens, ways, MAX_STREAMS, e), free=f, exact=exact, runtime=r)
        for n, (start, end), share, f, r, e in zip(ring, ranges, shares, free, runtimes, ranks, strict=True)
    )
    if draft is not None and len(ring) == 1 and (engines or ["torch"])[0] == "torch":
        extra = draft_weights(draft) + tokens * kv_bytes_per_token(draft, draft.n_layers)
        plans = (replace(plans[0], draft=extra),)
    return plans
