"""This rank's compute: the model slice, the KV tensors, the link to the other ranks and a draft model, and the
forward pass over them (issue 39: the Executor half of the engine).

The Executor holds no request bookkeeping: no queue, no running rows, no block tables of its own. The engine
(step.py) hands it the rows of the step a header names and their block tables; it turns them into tensors
(cache.StepBatch, MixedBatch), receives hidden states from the previous rank or embeds ids, runs this rank's
layers against the KV cache, and sends the hidden states on or returns the logits. The block pool's size is the
scheduler's decision (core.build_parts); the Executor only holds tensors of that size, and remakes them when a
group agrees on a smaller pool (engine._agree_pool).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .cache import KVCache, MixedBatch, StepBatch
from .drafter import Drafter
from .links import Link
from .mrope import rope_rows
from .options import Shard
from .pace import module_bytes
from .requests import Request
from .vision import image_mask, image_rows

PromptPart = tuple[int, Request, int, int]
"""(row, request, start, end): the prompt positions [start, end) one step prefills for the request in row."""


def make_cache(model: Any, blocks: int, block_size: int, local: int | None, bits: int) -> Any:
    """The KV cache for pools of these sizes (a hybrid model's sliding layers in their own, `local` blocks), at
    `bits`; an MLX stage of a mixed group takes neither local nor bits (and keeps no cache here)."""
    if bits == 16 and local is None:
        return model.make_cache(blocks, block_size)
    return model.make_cache(blocks, block_size, local_blocks=local, bits=bits)


def _padded(tables: Sequence[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 tensor, each row padded with block 0 to the longest."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


class Executor:
    """One rank's model slice, KV cache, link and drafter, and the forward pass over them."""

    def __init__(self, shard: Shard, model: Any, cache: Any, link: Link, drafter: Drafter | None, *,
                 device: torch.device, block_size: int, kv_bits: int) -> None:
        self.shard, self.model, self.cache, self.link, self.drafter = shard, model, cache, link, drafter
        self.device, self.block_size, self.kv_bits = device, block_size, kv_bits
        self.is_sampler = shard.is_sampler
        self.needs_ids = shard.tensor or shard.rank == 0  # who embeds token ids

    def resize(self, blocks: int, local: int | None) -> None:
        """New KV tensors for pools of these sizes (a group's agreed smallest; nothing was written yet)."""
        self.cache = make_cache(self.model, blocks, self.block_size, local, self.kv_bits)

    def copy_block(self, source: int, dest: int, group: int = 0) -> None:
        """One KV block's rows copied (an admission that shares a partly filled block copies it)."""
        if group:
            self.cache.copy_block(source, dest, group=group)
        else:
            self.cache.copy_block(source, dest)

    # --- a step's tensors, from the rows the engine hands over ---------------------------------------------

    def decode_batch(self, running: Sequence[Request], local: bool) -> StepBatch:
        """One decode row per request, at its length, over its block table(s)."""
        tables = _padded([r.table for r in running], self.device)
        return StepBatch.build(torch.tensor([[r.length] for r in running], device=self.device), tables,
                               kv_len=max(r.length for r in running) + 1, local=self.local_tables(running, local),
                               rope=rope_rows([(r.mrope, r.length, r.length + 1) for r in running], self.device))

    def local_tables(self, running: Sequence[Request], local: bool) -> torch.Tensor | None:
        """A hybrid model's sliding tables of the rows, padded like the full group's (None: one group)."""
        return _padded([r.local for r in running], self.device) if local else None

    def chunk_batch(self, part: PromptPart, local: bool) -> StepBatch:
        """A prompt part's positions over its request's tables (M-RoPE's three where the request has them); an
        image's positions attend both ways where the family's do (Gemma 3)."""
        _, req, start, end = part
        tables = torch.tensor([req.table], dtype=torch.int32, device=self.device)
        local_table = torch.tensor([req.local], dtype=torch.int32, device=self.device) if local else None
        batch = StepBatch.build(torch.arange(start, end, device=self.device).unsqueeze(0), tables, kv_len=end,
                                local=local_table, rope=rope_rows([(req.mrope, start, end)], self.device))
        if not req.spans or not self.model.args.images_bidirectional:
            return batch
        mask = image_mask(req.spans, start, end, self.device)
        return dataclasses.replace(batch, mask=batch.mask | mask, bidirectional=True) if mask is not None else batch

    def verify_batch(self, running: Sequence[Request], drafts: Sequence[list[int]],
                     local: bool) -> tuple[torch.Tensor, MixedBatch]:
        """A speculative step's input: per request its last token and draft as one chunk (a MixedBatch part)."""
        parts, ids = [], []
        for req, draft in zip(running, drafts, strict=True):
            tokens = [req.last_token, *draft]
            ids += tokens
            table = torch.tensor([req.table], dtype=torch.int32, device=self.device)
            positions = torch.arange(req.length, req.length + len(tokens), device=self.device).unsqueeze(0)
            parts.append(StepBatch.build(positions, table, kv_len=req.length + len(tokens),
                                         local=self.local_tables([req], local),
                                         rope=rope_rows([(req.mrope, req.length, req.length + len(tokens))],
                                                        self.device)))
        return torch.tensor([ids], device=self.device), MixedBatch(tuple(parts))

    def inputs(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input: its ids (ids), or on rank 0 where a chunk holds image positions, their embeddings
        with those rows replaced by the vision tower's (vision.image_rows)."""
        ids = self.ids(last_tokens, chunks)
        if ids is None or not any(req.vision is not None for _, req, _, _ in chunks):
            return ids
        h = self.model.embed(ids)
        at = len(last_tokens)
        for _, req, start, end in chunks:
            if req.vision is not None:
                offsets, index = image_rows(req.spans, start, end)
                if offsets:
                    h[0, [at + o for o in offsets]] = req.vision.embeds[index].to(h.dtype)
            at += end - start
        return h

    def ids(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input ids as one sequence: decode rows' last tokens, then each chunk's prompt tokens (None
        on a rank that receives hidden states instead)."""
        if not self.needs_ids:
            return None
        return torch.tensor([[*last_tokens, *(t for _, req, start, end in chunks for t in req.prompt[start:end])]],
                            device=self.device)

    # --- the forward pass ----------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor | None, batch: StepBatch | MixedBatch, shape: tuple[int, int], *,
                last_only: bool = False) -> torch.Tensor | None:
        """Run this rank's part of the forward pass; the sampler gets logits, everyone else None."""
        if ids is not None:
            x = ids
        else:
            x = self.link.recv_hidden((*shape, self.model.args.hidden_size), self.model.args.dtype, self.device)
        out = self.model(x, batch, self.cache, last_only=last_only)
        if self.shard.kind == "pipeline" and not self.is_sampler:
            self.link.send_hidden(out)
            return None
        return out if self.is_sampler else None

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation) this rank holds: its slice's tensors and a draft
        model's, each storage once (fused projections are views of one buffer), and the KV pools it zeroed when it
        allocated them (cache.ZEROED_BELOW)."""
        drafter = self.drafter
        models = [m for m in (self.model, drafter.model if drafter else None) if isinstance(m, nn.Module)]
        caches = [c for c in (self.cache, drafter.cache if drafter else None) if isinstance(c, KVCache)]
        return sum(module_bytes(m) for m in models), sum(c.zeroed_nbytes for c in caches)

