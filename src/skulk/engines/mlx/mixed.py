"""An MLX rank inside a torch engine's group: one Pipeline instance whose ranks run different engines (a Mac's
MLX beside a Linux box's torch), as llama.cpp's RPC mixes backends.

The two engines' own multi-rank protocols differ (the MLX ring shares adds and tokens by all_sum over
mx.distributed; the torch group broadcasts step headers over gloo), so a mixed instance speaks one of them
everywhere: the torch engine's. Every rank joins the torch.distributed group at the rendezvous, and the MLX
rank is a `TorchEngine` built from the same parts but its Executor (MixedMlxEngine, MlxExecutor): its scheduling,
step headers (wire.py: fixed int64s and pydantic-validated JSON, never pickle), block bookkeeping, hidden-state
sends and token shares (links.py) are the torch engine's own code; only its forward pass is mlx-lm's model, cut to
this rank's layers (`MlxStage`). Hidden states cross as torch tensors in the checkpoint's dtype (bf16 goes through
an int16 view: numpy has no bfloat16).

mlx-lm's layers keep KV caches per sequence, not the torch engine's block pool, so the MLX rank keeps mlx-lm
caches for its running requests (caches.py): a step's decode rows run as one batched forward over a
BatchKVCache, as mlx-lm's batch generation does (the torch engine's continuous batching: one pass for every
running request), a prefill chunk on its request's own cache. Two things follow. A decode row of a request still
being prefilled (the torch engine computes it and drops its output) is skipped here: on mlx-lm's cache it
would take the position the chunk writes. And a request admitted onto another's cached prefix blocks has no
MLX cache to start from, so a mixed instance shares no prefixes (`share_prefixes`, off on every rank). The
cache of a request that leaves (released, or preempted and later recomputed from its first position) is
dropped at the next forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx_lm.models.cache import make_prompt_cache

from skulk.engines.torch.cache import MixedBatch, StepBatch
from skulk.engines.torch.core import Parts, build_parts
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.executor import Executor, PromptPart
from skulk.engines.torch.models import read_args_dir
from skulk.engines.torch.options import Pool, Shard, Weights
from skulk.engines.torch.requests import Request

from .caches import SequenceCaches
from .engine import load, set_wired_limit
from .ring import inner_model, keep_layers, swap_layer

Rows = list[Request | None]
"""The request each row of a batch part computes for (None: a row the MLX rank skips)."""


def to_mx(x: torch.Tensor) -> mx.array:
    """A torch tensor as an MLX array of the same dtype (bf16 through an int16 view)."""
    if x.dtype == torch.bfloat16:
        return mx.array(x.contiguous().view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(x.contiguous().numpy())


def from_mx(x: mx.array, dtype: torch.dtype) -> torch.Tensor:
    """An MLX array as a torch tensor of `dtype` (bf16 through an int16 view)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.array(x.astype(mx.bfloat16).view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(x.astype(mx.float32))).to(dtype)


class MlxStage:
    """mlx-lm's model cut to layers [start, end): token ids (first stage) or a hidden state in, the next hidden
    state (or, on the last stage, logits) out, one sequence at a time on that sequence's own mlx-lm cache.

    It stands where the torch engine keeps its ModelSlice: `args` (the checkpoint's, read by the torch engine's
    own config code, so both engines agree on the wire's dtype and width), the KV bytes a position costs (the
    block pool's sizing, which a group agrees on) and an unused `make_cache` (the pool lives in the caches)."""

    def __init__(self, model_dir: Path, start: int, end: int | None, quantize: str | None) -> None:
        args = read_args_dir(model_dir)
        self.args = dataclasses.replace(args, dtype=torch.bfloat16) if quantize is not None else args
        self.start, self.end = start, args.num_hidden_layers if end is None else end
        self.is_first, self.is_last = self.start == 0, self.end == args.num_hidden_layers
        self._given: mx.array | None = None  # the hidden state the first kept layer takes instead of its input
        self._taken: mx.array | None = None  # the last kept layer's output (a stage that is not last)
        self.forwards = self.rows = 0  # forward passes run, and the sequences they computed (a batch: several)
        self.model, _ = load(model_dir, quantize, self._cut)
        set_wired_limit(self.model)

    def _cut(self, model: nn.Module) -> None:
        inner = inner_model(model)
        layers = list(inner.layers)
        if not 0 <= self.start < self.end <= len(layers):
            raise ValueError(f"layers [{self.start}, {self.end}) of a {len(layers)}-layer model")
        kept = layers[self.start : self.end]
        stage = self

        def given(cls: type) -> Any:
            def call(layer: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
                assert stage._given is not None
                return cls.__call__(layer, stage._given, *args, **kwargs)
            return call

        def taken(cls: type) -> Any:
            def call(layer: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
                out: mx.array = cls.__call__(layer, x, *args, **kwargs)
                stage._taken = out
                return out
            return call

        if not self.is_first:
            swap_layer(kept[0], given)
        if not self.is_last:
            swap_layer(kept[-1], taken)
        keep_layers(inner, kept)

    def kv_bytes_per_token(self) -> int:
        a = self.args
        return 2 * (self.end - self.start) * a.num_key_value_heads * a.head_dim * a.dtype.itemsize

    def make_cache(self, num_blocks: int, block_size: int) -> None:
        """The torch engine's block pool: unused here (each request has an mlx-lm cache, MixedMlxEngine)."""
        del num_blocks, block_size

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def run(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Sequences' positions, one row each: x is [B, T] token ids (first stage) or [B, T, hidden]; out
        [B, T, hidden] (the hidden state for the next stage) or [B, vocab] (each row's last logits, last stage)."""
        ids = x if self.is_first else mx.zeros(x.shape[:2], dtype=mx.int32)  # embedded, then replaced
        self._given = None if self.is_first else x
        self.forwards, self.rows = self.forwards + 1, self.rows + x.shape[0]
        try:
            if self.is_last:
                out = self.model(ids, cache=cache)[:, -1]
            else:
                inner_model(self.model)(ids, cache=cache)
                assert self._taken is not None
                out = self._taken
            mx.eval(out)
            return out
        finally:
            self._given = self._taken = None


class MlxExecutor(Executor):
    """The torch engine's Executor computing with an MlxStage: the same batches (it notes each part's requests as it
    builds them) and the same link, with mlx-lm's forward pass over a cache per request (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running: Callable[[], Sequence[Request]] = list
        """The engine's running rows (MixedMlxEngine sets it): a request that left has its cache dropped."""
        self._rows: dict[int, Rows] = {}  # id(batch part) -> its rows' requests, for this step's forward
        self._caches = SequenceCaches(lambda: cast(MlxStage, self.model).new_cache())

    # --- where each row of a step comes from (the torch engine builds the batches; these note their requests) ---

    def decode_batch(self, running: Sequence[Request], local: bool) -> StepBatch:
        """The torch batch, with the rows that sample noted (a row still being prefilled is skipped)."""
        batch = super().decode_batch(running, local)
        self._rows[id(batch)] = [r if r.length >= len(r.prompt) else None for r in running]
        return batch

    def chunk_batch(self, part: PromptPart, local: bool) -> StepBatch:
        batch = super().chunk_batch(part, local)
        self._rows[id(batch)] = [part[1]]
        return batch

    def forward(self, ids: torch.Tensor | None, batch: StepBatch | MixedBatch, shape: tuple[int, int], *,
                last_only: bool = False) -> torch.Tensor | None:
        """The torch Executor's forward (receive, compute, send on or return logits) with mlx-lm computing."""
        args = self.model.args
        x = ids if ids is not None else self.link.recv_hidden((*shape, args.hidden_size), args.dtype, self.device)
        parts = batch.parts if isinstance(batch, MixedBatch) else (batch,)
        try:
            outs = self._compute(x.reshape(-1, *x.shape[2:]), parts)
        finally:
            self._rows.clear()
        self._drop_caches()
        if not self.is_sampler:
            self.link.send_hidden(torch.cat(outs).reshape(x.shape[0], x.shape[1], -1))
            return None
        logits = torch.stack(outs)  # one row per sequence: its last position
        return logits.unsqueeze(1) if isinstance(batch, StepBatch) and x.shape[1] == 1 else logits.unsqueeze(0)

    def _compute(self, flat: torch.Tensor, parts: Sequence[StepBatch]) -> list[torch.Tensor]:
        """Each part's rows in row order: per sequence its hidden rows [T, hidden] or, on the last stage, its last
        position's float32 logits [vocab]. A decode part's rows run as one batch (SequenceCaches), a prefill
        chunk on its request's own cache."""
        stage = cast(MlxStage, self.model)
        outs: list[torch.Tensor] = []
        at = 0
        for part in parts:
            rows, width = self._rows[id(part)], part.positions.shape[1]
            block = flat[at : at + width * len(rows)].reshape(len(rows), width, *flat.shape[1:])
            at += width * len(rows)
            live = [b for b, req in enumerate(rows) if req is not None]
            got = self._run_rows(stage, block, part, live, [cast(Request, rows[b]) for b in live]) if live else None
            skipped = (torch.zeros(stage.args.vocab_size) if stage.is_last
                       else torch.zeros(width, stage.args.hidden_size, dtype=stage.args.dtype))
            for b in range(len(rows)):  # a prefilling request's decode row gets zeros: its output is dropped
                outs.append(got[live.index(b)] if got is not None and b in live else skipped)
        return outs

    def _run_rows(self, stage: MlxStage, block: torch.Tensor, part: StepBatch, live: list[int],
                  reqs: list[Request]) -> torch.Tensor:
        """These rows of the part in one forward pass: [rows, T, hidden] or [rows, vocab] float32 logits."""
        positions = [int(part.positions[b, 0]) for b in live]
        if len(reqs) == 1:
            cache = self._cache_for(reqs[0], positions[0])
        else:
            cache = self._caches.batch([r.request_id for r in reqs], positions)
        out = stage.run(to_mx(block[live]), cache)
        return from_mx(out, torch.float32 if stage.is_last else stage.args.dtype)

    def _cache_for(self, req: Request, position: int) -> list[Any]:
        """The request's own mlx-lm cache, which must end where this step's positions start (a fresh one at 0)."""
        return self._caches.one(req.request_id, position)

    def _drop_caches(self) -> None:
        running = self.running()
        if len(self._caches) > len(running):
            self._caches.keep({r.request_id for r in running})


class MixedMlxEngine(TorchEngine):
    """The torch engine's parts over its group link, computing with an MlxStage (module docstring): only the parts
    it is built from differ (build)."""

    @classmethod
    def build(cls, model_dir: Path, shard: Shard, pool: Pool, weights: Weights) -> Parts:
        """The torch engine's parts with an MlxStage for the model and an MlxExecutor over it; no shared prefixes."""
        parts = build_parts(model_dir, shard, pool, weights, load=load_stage, executor=MlxExecutor,
                            share_prefixes=False)
        scheduler = parts.scheduler
        cast(MlxExecutor, parts.executor).running = lambda: scheduler.running
        return parts


def load_stage(model_dir: Path, *, start_layer: int, end_layer: int | None, tp_size: int, quantize: str | None,
               **_: Any) -> MlxStage:
    """This rank's layers as an MlxStage (core.Loader's keywords): a Pipeline stage only."""
    if tp_size > 1:
        raise ValueError("an MLX rank joins a torch group as a Pipeline stage only")
    return MlxStage(model_dir, start_layer, end_layer, quantize)
