"""Speculative decoding with a draft model: a smaller model of the same tokenizer proposes each request's next
tokens one cheap step at a time (a greedy request's argmax; a sampled request's drawn under its own temperature,
top-k, top-p and generator); the target verifies them all in one forward pass (local_step.py).

The draft's KV cache is a second pool with the target's geometry (blocks of the same size, as many), so every
request's block table addresses both: no second allocator, and blocks the target frees free the draft's rows too.
The draft is never asked to be right, only often right: output is whatever greedy decoding of the target gives
(the verification keeps only the draft's prefix the target confirms), or for a sampled request exactly the
target's sampling distribution (speculate.verify_sampled's rejection rule), so stale or foreign draft KV (a block shared
from another request's prefix, copied, or written past a rejected token) costs acceptance, never correctness.
Each request records how far its draft KV is valid (`Request.draft_len`); the next proposal first feeds the draft
the tokens from there (the whole prompt the first time, in chunks), then drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .cache import KVCache, MixedBatch, StepBatch
from .loader import load_model
from .model import ModelSlice
from .models import read_args_dir
from .requests import Request
from .sampling import distribution, draw, greedy

Draws = torch.Tensor | None
"""The distributions a sampled request's draft tokens were drawn from, [tokens, V] (None: greedy, or no draft)."""

DRAFT_TOKENS = 4
"""Tokens the draft model proposes per request and step: each costs one draft step, so fewer than prompt lookup's
free MAX_DRAFT."""


class Drafter:
    """A draft model and its cache beside a single-rank target."""

    def __init__(self, model: ModelSlice, num_blocks: int, block_size: int, chunk: int) -> None:
        self.model, self.block_size, self.chunk = model, block_size, chunk
        self.cache: KVCache = model.make_cache(num_blocks, block_size)

    @classmethod
    def load(cls, draft_dir: Path, target: ModelSlice, num_blocks: int, block_size: int, chunk: int, *,
             dtype: str | torch.dtype | None, device: torch.device, quantize: str | None) -> Drafter:
        """The draft checkpoint at draft_dir; it must share the target's vocabulary (the same tokenizer)."""
        vocab = read_args_dir(draft_dir).vocab_size  # checked before any weight is read
        if vocab != target.args.vocab_size:
            raise ValueError(f"draft model {draft_dir.name} has a vocabulary of {vocab} tokens, the target "
                             f"{target.args.vocab_size}: a draft must use the target's tokenizer")
        return cls(load_model(draft_dir, dtype=dtype, device=device, quantize=quantize), num_blocks, block_size, chunk)

    def propose(self, reqs: Sequence[Request], limits: Sequence[int]) -> tuple[list[list[int]], list[Draws]]:
        """Up to limits[i] draft tokens for reqs[i] (none where the limit is 0), each request's table already
        holding blocks for every position the draft writes (up to length + limit - 1): a greedy request's the draft's
        argmax, a sampled one's drawn from the draft's distribution under the request's own settings and generator,
        returned beside them ([tokens, V], for the rejection rule; None for a greedy request)."""
        drafts: list[list[int]] = [[] for _ in reqs]
        dists: list[list[torch.Tensor]] = [[] for _ in reqs]
        rows = [i for i, limit in enumerate(limits) if limit > 0]
        if not rows:
            return drafts, [None] * len(reqs)
        device = next(self.model.parameters()).device
        tables = {i: torch.tensor([reqs[i].table], dtype=torch.int32, device=device) for i in rows}
        logits = self._catch_up([reqs[i] for i in rows], [tables[i] for i in rows], device)
        self._pick(logits, rows, reqs, drafts, dists)
        for step in range(1, max(limits)):
            rows = [i for i in rows if limits[i] > step]
            if not rows:
                break
            positions = torch.tensor([[reqs[i].length + step] for i in rows], device=device)
            width = max(len(reqs[i].table) for i in rows)
            table = torch.tensor([reqs[i].table + [0] * (width - len(reqs[i].table)) for i in rows],
                                 dtype=torch.int32, device=device)
            ids = torch.tensor([[drafts[i][-1]] for i in rows], device=device)
            batch = StepBatch.build(positions, table, kv_len=int(positions.max().item()) + 1)
            self._pick(self.model(ids, batch, self.cache)[:, -1], rows, reqs, drafts, dists)
        return drafts, [torch.stack(d) if d else None for d in dists]

    @staticmethod
    def _pick(logits: torch.Tensor, rows: Sequence[int], reqs: Sequence[Request], drafts: list[list[int]],
              dists: list[list[torch.Tensor]]) -> None:
        """Append each row's next draft token (logits[j] is reqs[rows[j]]'s) and, for a sampled request, the
        distribution it was drawn from."""
        picks = greedy(logits).tolist()
        sampled = [j for j, i in enumerate(rows) if reqs[i].sampling.temperature > 0]
        if sampled:
            settings = [reqs[rows[j]].sampling for j in sampled]
            probs = distribution(logits[sampled], settings)
            for j, row, token in zip(sampled, probs, draw(probs, [s.generator for s in settings]).tolist(),
                                     strict=True):
                picks[j] = token
                dists[rows[j]].append(row)
        for i, token in zip(rows, picks, strict=True):
            drafts[i].append(token)

    def _catch_up(self, reqs: Sequence[Request], tables: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Feed the draft each request's tokens from its draft_len through its last token (at its length): one pass
        over every request while they fit a chunk (the steady state: a token or two each), else request by request
        in chunks (a prompt's first proposal). Each request's logits after its last token [len(reqs), V]."""
        todo = [[*r.tokens(r.draft_len, r.length), r.last_token] for r in reqs]
        if sum(map(len, todo)) <= self.chunk:
            return self._feed(todo, [r.draft_len for r in reqs], tables, device)
        firsts: list[torch.Tensor] = []
        for req, tokens, table in zip(reqs, todo, tables, strict=True):
            start = req.draft_len
            while len(tokens) > self.chunk:
                self._feed([tokens[: self.chunk]], [start], [table], device)
                tokens, start = tokens[self.chunk :], start + self.chunk
            firsts.append(self._feed([tokens], [start], [table], device))
        return torch.cat(firsts)

    def _feed(self, chunks: Sequence[list[int]], starts: Sequence[int], tables: Sequence[torch.Tensor],
              device: torch.device) -> torch.Tensor:
        """One draft pass over each chunk at its start positions; the logits after each chunk's last token."""
        parts = tuple(StepBatch.build(torch.arange(start, start + len(chunk), device=device).unsqueeze(0), table,
                                      kv_len=start + len(chunk))
                      for chunk, start, table in zip(chunks, starts, tables, strict=True))
        x = torch.tensor([[t for chunk in chunks for t in chunk]], device=device)
        logits = self.model(x, parts[0] if len(parts) == 1 else MixedBatch(parts), self.cache, last_only=True)
        return logits[0]
