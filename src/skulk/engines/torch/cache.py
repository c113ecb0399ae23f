"""The KV cache: one preallocated buffer per layer, one row (slot) per request, never reallocated.

Layout per layer is [max_slots, n_kv_heads, max_seq, head_dim]. A step works on a contiguous range of slots,
so the rows it reads are a view of the buffer, not a gather; the engine keeps running requests packed into
slots [0, n) by moving the last request into a freed slot (one copy per finished request, none per token).
Stale entries past a request's length are never read: the attention mask stops at each slot's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Where one forward pass reads and writes: built once per step and shared by every layer.

    positions[b, t] is the absolute position of input token t of batch row b, which is also where its key and
    value are stored in slot slots.start + b. mask[b, 0, t, s] allows key s for that token (s <= position).
    """

    slots: slice
    rows: torch.Tensor  # [B, 1] row index into the slot range, for scatter writes
    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, 1, T, kv_len] bool
    kv_len: int
    window: int = 0  # a sliding-window layer's batch: each token sees its last `window` keys only (0: all)

    @classmethod
    def build(cls, positions: torch.Tensor, slot_start: int, kv_len: int | None = None) -> StepBatch:
        """A batch over slots [slot_start, slot_start + B) whose tokens sit at positions ([B, T] long).

        kv_len is max(positions) + 1; a caller that knows it passes it to spare a device sync per step.
        """
        batch = positions.shape[0]
        if kv_len is None:
            kv_len = int(positions.max().item()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        mask = keys.view(1, 1, 1, kv_len) <= positions.view(batch, 1, -1, 1)
        rows = torch.arange(batch, device=positions.device).view(batch, 1)
        return cls(slice(slot_start, slot_start + batch), rows, positions, mask, kv_len)


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
    """Keys and values of one layer for every slot."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def update(
        self, k: torch.Tensor, v: torch.Tensor, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's keys/values ([B, H, T, D]) in place; return views of each slot's first kv_len."""
        keys, values = self.keys[batch.slots], self.values[batch.slots]
        keys[batch.rows, :, batch.positions] = k.transpose(1, 2)
        values[batch.rows, :, batch.positions] = v.transpose(1, 2)
        return keys[:, :, : batch.kv_len], values[:, :, : batch.kv_len]


class KVCache:
    """The cache of one model slice: a LayerCache per owned layer, indexed by local layer number."""

    def __init__(
        self,
        n_layers: int,
        max_slots: int,
        n_kv_heads: int,
        max_seq: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (max_slots, n_kv_heads, max_seq, head_dim)
        self.max_slots, self.max_seq = max_slots, max_seq
        self.layers = [LayerCache(shape, dtype, torch.device(device)) for _ in range(n_layers)]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first length positions of slot src into slot dst (compaction after a request leaves)."""
        for layer in self.layers:
            layer.keys[dst, :, :length] = layer.keys[src, :, :length]
            layer.values[dst, :, :length] = layer.values[src, :, :length]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        """Exchange the first length positions of two slots (a leaving request and the last running one)."""
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                held = buf[a, :, :length].clone()
                buf[a, :, :length] = buf[b, :, :length]
                buf[b, :, :length] = held

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in (layer.keys, layer.values))
