"""The paged KV cache: per layer one pool of fixed-size blocks, [num_blocks, n_kv_heads, block_size, head_dim],
never reallocated; each request reads and writes through its block table (blocks.BlockAllocator decides which
blocks; this module only moves tensors).

Position p of a request lives in block table[p // block_size], row p % block_size. A decode step's kernels read
the blocks in place (cpu_step.c walks each row's table block by block); the torch path (prefill chunks, other
devices) writes through the same index and gathers a step's blocks into a contiguous view to attend. Stale rows
past a request's length are never attended: the mask (and the kernels' loop bounds) stop at each row's position.
A pool of one block per request of the whole context is exactly the old contiguous per-slot layout.

A hybrid model (Gemma 3: sliding-window layers among global ones, engines/kv_pools.py) has two layer groups: its
sliding layers' pools have their own, smaller number of blocks and each request a second block table for them
(StepBatch.local), holding only the blocks inside its window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skulk.engines.kv_pools import kv_head_bytes

from . import kv_quant


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Where one forward pass reads and writes: built once per step and shared by every layer.

    positions[b, t] is the absolute position of input token t of batch row b; tables[b] is that row's block table
    (int32, padded with 0 past the blocks it holds: never read). mask[b, 0, t, s] allows key s for that token.
    """

    tables: torch.Tensor  # [B, n_blocks] int32
    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, 1, T, kv_len] bool
    kv_len: int
    window: int = 0  # a sliding-window layer's batch: each token sees its last `window` keys only (0: all)
    local: torch.Tensor | None = None  # a hybrid model's sliding layers' block tables [B, n] (None: `tables`)
    bidirectional: bool = False  # the mask lets an image's tokens see each other both ways (vision.py)
    rope: torch.Tensor | None = None
    """The positions rope turns the tokens by where they are not `positions`: multimodal rope's [3, B, T]
    (mrope.py); None: `positions`."""

    @property
    def rope_positions(self) -> torch.Tensor:
        return self.positions if self.rope is None else self.rope

    @classmethod
    def build(cls, positions: torch.Tensor, tables: torch.Tensor | int, kv_len: int | None = None,
              local: torch.Tensor | None = None, rope: torch.Tensor | None = None) -> StepBatch:
        """A batch whose row b sits at positions[b] ([B, T] long) through block table tables[b]; an int `first`
        gives row b the one block first + b (a cache whose blocks hold a whole sequence: one per slot).

        kv_len is max(positions) + 1; a caller that knows it passes it to spare a device sync per step.
        """
        batch = positions.shape[0]
        if isinstance(tables, int):
            tables = torch.arange(tables, tables + batch, dtype=torch.int32, device=positions.device).view(batch, 1)
        if kv_len is None:
            kv_len = int(positions.max().item()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        mask = keys.view(1, 1, 1, kv_len) <= positions.view(batch, 1, -1, 1)
        return cls(tables, positions, mask, kv_len, local=local, rope=rope)

    def write_index(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of every input token in a cache of block_size positions a block, [B, T] each."""
        blocks = self.tables.long().gather(1, torch.div(self.positions, block_size, rounding_mode="floor"))
        return blocks, self.positions % block_size


@dataclass(frozen=True, slots=True)
class MixedBatch:
    """A step whose rows are several batches' tokens side by side in one sequence ([1, rows, hidden]): the running
    requests' decode rows, then a prefill chunk. Everything but attention treats the rows alike, so the chunk
    rides on the decode step's one read of the weights; attention splits them back into their batches (in
    order: a later part's cache writes land after an earlier part's)."""

    parts: tuple[StepBatch, ...]

    @property
    def sizes(self) -> list[int]:
        """Token rows per part."""
        return [part.positions.numel() for part in self.parts]


class LayerCache:
    """Keys and values of one layer: a pool of blocks [num_blocks, n_kv_heads, block_size, head_dim]; value_dim: the
    values' own width where it differs (0: a layer that stores keys only, MLA's latent: models/deepseek_v3.py)."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                 value_dim: int | None = None) -> None:
        self.keys = _pool(shape, dtype, device)
        self.values = _pool(_values(shape, value_dim), dtype, device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's keys/values ([B, H, T, D]) through the block tables; return each row's first kv_len
        positions gathered contiguous ([B, H, kv_len, D])."""
        blocks, rows = batch.write_index(self.keys.shape[2])
        self.keys[blocks, :, rows] = k.transpose(1, 2)
        self.values[blocks, :, rows] = v.transpose(1, 2)
        return self.gather(batch.tables, batch.kv_len)

    def gather(self, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each table's first `length` positions as contiguous [B, H, length, D] keys and values."""
        size = self.keys.shape[2]
        used = tables[:, : -(-length // size)].long()
        b, n = used.shape
        keys = self.keys[used].transpose(1, 2).reshape(b, self.keys.shape[1], n * size, self.keys.shape[3])
        values = self.values[used].transpose(1, 2).reshape(b, self.values.shape[1], n * size, self.values.shape[3])
        return keys[:, :, :length], values[:, :, :length]

    def copy_block(self, src: int, dst: int) -> None:
        """Block dst gets block src's keys and values."""
        for pool in self.tensors:
            pool[dst] = pool[src]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every pool this layer holds (what its bytes are)."""
        return self.keys, self.values


class QuantizedLayerCache(LayerCache):
    """Keys and values of one layer in 8 or 4 bits (kv_quant.py): the same block pools and tables, the elements
    quantized ([num_blocks, n_kv_heads, block_size, packed width]) beside their float16 scales.

    A step's writes are quantized as they are stored; its gathered blocks are dequantized once, to the
    activations' dtype, and attended by the torch path. The CPU kernels, which read a float pool in place, never
    see such a cache: their dtype checks (layers.py) find int8/uint8 pools and step aside."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, bits: int,
                 value_dim: int | None = None) -> None:
        self.bits, self.dtype = bits, dtype
        self.keys, self.key_scales = _quantized_pools(shape, bits, device)
        self.values, self.value_scales = _quantized_pools(_values(shape, value_dim), bits, device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, rows = batch.write_index(self.keys.shape[2])
        for x, data, scales in ((k, self.keys, self.key_scales), (v, self.values, self.value_scales)):
            if not x.shape[-1]:
                continue  # a keys-only layer's empty values
            q, s = kv_quant.quantize(x.transpose(1, 2), self.bits)
            data[blocks, :, rows] = q
            scales[blocks, :, rows] = s
        return self.gather(batch.tables, batch.kv_len)

    def gather(self, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.keys.shape[2]
        used = tables[:, : -(-length // size)].long()
        b, n = used.shape
        out = []
        for data, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            if not data.shape[-1]:
                out.append(data.new_empty((b, data.shape[1], length, 0), dtype=self.dtype))
                continue
            full = kv_quant.dequantize(data[used], scales[used], self.bits, self.dtype)  # [b, n, H, size, D]
            out.append(full.transpose(1, 2).reshape(b, data.shape[1], n * size, -1)[:, :, :length])
        return out[0], out[1]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values, self.key_scales, self.value_scales


ZEROED_BELOW = 64 << 20
"""A CPU pool smaller than this is zeroed when allocated (resident at once); a larger one is touched as used."""


def _quantized_pools(shape: tuple[int, int, int, int], bits: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed elements and float16 scales of [blocks, heads, size, dim] at `bits` (empty at dim 0)."""
    blocks, heads, size, dim = shape
    width, groups = (kv_quant.packed_width(dim, bits), kv_quant.scale_groups(dim, bits)) if dim else (0, 0)
    store = torch.int8 if bits == 8 else torch.uint8
    return (_pool((blocks, heads, size, width), store, device),
            _pool((blocks, heads, size, groups), torch.float16, device))


def _values(shape: tuple[int, int, int, int], value_dim: int | None) -> tuple[int, int, int, int]:
    """The value pool's shape: the keys' unless value_dim says its own width."""
    return shape if value_dim is None else (*shape[:3], value_dim)


def _pool(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool. A large one on the CPU comes from fresh pages the kernel maps zeroed on first touch, so memory
    follows the blocks actually used; a small one (from the heap, maybe dirty) is zeroed: a gathered block's unused
    rows are masked, but a NaN there would still poison the weighted sum."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if _zeroed(tensor):
        tensor.zero_()
    return tensor


def _zeroed(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" or tensor.nbytes < ZEROED_BELOW


class KVCache:
    """The cache of one model slice: a LayerCache per owned layer, indexed by local layer number. local: per owned
    layer, whether it belongs to a hybrid model's sliding group, whose pools hold local_blocks blocks (empty: one
    group)."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        n_kv_heads: int,
        block_size: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        local: tuple[bool, ...] = (),
        local_blocks: int = 0,
        bits: int = 16,
        value_dim: int | None = None,
    ) -> None:
        """bits: 16 keeps the model's float dtype; 8 or 4 quantize (QuantizedLayerCache); value_dim: the values'
        width where it is not head_dim (LayerCache)."""
        self.num_blocks, self.block_size, self.local_blocks = num_blocks, block_size, local_blocks
        self.bits = bits
        self.groups = [int(g) for g in local] or [0] * n_layers
        sizes = (num_blocks, local_blocks)
        where = torch.device(device)
        self.layers = [
            LayerCache((sizes[g], n_kv_heads, block_size, head_dim), dtype, where, value_dim) if bits == 16
            else QuantizedLayerCache((sizes[g], n_kv_heads, block_size, head_dim), dtype, where, bits, value_dim)
            for g in self.groups
        ]

    def copy_block(self, src: int, dst: int, group: int = 0) -> None:
        """Copy-on-write: block dst gets block src's keys and values in every layer of the group."""
        for layer, g in zip(self.layers, self.groups, strict=True):
            if g == group:
                layer.copy_block(src, dst)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors)

    @property
    def zeroed_nbytes(self) -> int:
        """The pool's bytes made resident when it was allocated (_pool zeroes the small ones); the rest become
        resident as blocks are used."""
        return sum(t.nbytes for layer in self.layers for t in layer.tensors if _zeroed(t))

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, bits: int = 16,
                        value_dim: int | None = None) -> int:
        """KV bytes one position costs in a slice: a key and a value per kv head per layer, at `bits`
        (kv_pools.kv_head_bytes, the rule placement sizes pools by); a value of value_dim where it differs (0:
        none)."""
        float_bytes = torch.empty((), dtype=dtype).element_size()
        width = head_dim if value_dim is None else value_dim
        value = kv_head_bytes(width, bits, float_bytes) if width else 0
        return n_layers * n_kv_heads * (kv_head_bytes(head_dim, bits, float_bytes) + value)
