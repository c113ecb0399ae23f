"""The work one header names, on every rank: a prefill chunk, a decode step, or both in one forward pass (MIXED).

Pipeline: rank r runs its layers and sends the hidden states on; the last rank samples and sends [token, finished,
failed] per row back to rank 0. Tensor: every rank runs all layers on its shard with a real all_reduce; the last
rank samples and broadcasts. Only the sampler's step returns TokenOuts.
"""

from __future__ import annotations

import dataclasses

import torch

from skulk.engines.base import TokenOut
from skulk.types.runners import RunnerPhase

from .admission import Admission
from .cache import MixedBatch, StepBatch
from .links import TokenRows
from .mrope import rope_rows
from .requests import Request, accept_each
from .schedule import share_chunk
from .vision import image_mask, image_rows, whole_images
from .wire import Header, StepKind

PromptPart = tuple[int, Request, int, int]
"""(row, request, start, end): the prompt positions [start, end) one step prefills for the request in row."""

PHASES: dict[tuple[str, StepKind], RunnerPhase] = {
    ("pipeline", StepKind.PREFILL): "prefill_pipeline",
    ("pipeline", StepKind.DECODE): "decode_stream",
    ("tensor", StepKind.PREFILL): "prefill_barrier",
    ("tensor", StepKind.DECODE): "decode_barrier",
}
_EMA = 0.3  # weight of the newest step in the scheduler's running cost averages


class Step(Admission):
    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    def _measure(self, header: Header, seconds: float, tokens: int) -> None:
        """Rank 0's running average of a decode step and the cost of the last chunk that rode on one (chunk
        sizing): the time it added to it. A prefill step alone forgets it: its chunk ran alone, on another path and
        often at another size (a burst's prompts together), so it says little about what a riding chunk adds."""
        if header.kind == StepKind.DECODE:
            self._decode_s += _EMA * (seconds - self._decode_s) if self._decode_s else seconds
        elif header.kind == StepKind.MIXED:
            self._last_chunk = (tokens, max(seconds - self._decode_s, 0.0))
        elif header.kind == StepKind.PREFILL:
            self._last_chunk = None


    def _prefill(self, header: Header) -> list[TokenOut]:
        """The next chunk of every prompt being prefilled (one part each, several short prompts in one pass)."""
        self._enter_phase(PHASES[self.kind, StepKind.PREFILL], "prefill")
        chunks = self._chunks(header.chunk)
        parts = [self._chunk_batch(chunk) for chunk in chunks]
        batch = parts[0] if len(parts) == 1 else MixedBatch(tuple(parts))
        logits = self._forward(self._inputs([], chunks), batch, (1, self._chunk_done), last_only=True)
        done = self._finish(chunks)
        if not done:
            return []
        reqs = [chunks[j][1] for j in done]
        outs = self._accept(logits[0, done].unsqueeze(1), reqs) if logits is not None else []
        if self.is_scheduler and self.kind == "pipeline" and self.world_size > 1:
            self._enter_phase("decode_wait_first_token", "prefill_sent")
        self._share_tokens(reqs, outs)
        return outs

    def _mixed(self, header: Header) -> list[TokenOut]:
        """A decode step of every running request and the next chunk of the prompts being prefilled, in one
        forward pass (cache.MixedBatch): the chunks ride on the decode step's read of the weights."""
        self._enter_phase(PHASES[self.kind, StepKind.DECODE], "decode")
        chunks = self._chunks(header.chunk)
        # a row being prefilled decodes too (its token is dropped): its write at its length is overwritten by its
        # chunk, this step or a later one
        decode, last_tokens, rows = self._decode_rows()
        batch = MixedBatch((decode, *(self._chunk_batch(chunk) for chunk in chunks)))
        n = len(last_tokens)
        logits = self._forward(self._inputs(last_tokens, chunks), batch, (1, n + self._chunk_done), last_only=True)
        decoding = self._advance(rows)
        done = self._finish(chunks)
        reqs = [*decoding, *(chunks[j][1] for j in done)]
        outs: list[TokenOut] = []
        if logits is not None:  # rows: one per running request, then each chunk's last token
            outs = self._accept(logits[0, [*rows, *(n + j for j in done)]].unsqueeze(1), reqs)
        self._share_tokens(reqs, outs)
        return outs

    def _chunks(self, chunk: int) -> list[PromptPart]:
        """The prompt parts this step prefills (schedule.share_chunk), with _chunk_done set to their tokens."""
        prefilling = [(i, r) for i, r in enumerate(self._running) if r.length < len(r.prompt)]
        shares = share_chunk([len(r.prompt) - r.length for _, r in prefilling], chunk)
        shares = [whole_images(r.spans, r.length, take) if r.spans else take
                  for (_, r), take in zip(prefilling, shares, strict=True)]
        self._chunk_done = sum(shares)
        return [(i, r, r.length, r.length + take) for (i, r), take in zip(prefilling, shares, strict=True) if take]

    def _chunk_batch(self, part: PromptPart) -> StepBatch:
        _, req, start, end = part
        tables = torch.tensor([req.table], dtype=torch.int32, device=self.device)
        local = torch.tensor([req.local], dtype=torch.int32, device=self.device) if self.local_blocks else None
        batch = StepBatch.build(torch.arange(start, end, device=self.device).unsqueeze(0), tables, kv_len=end,
                                local=local, rope=rope_rows([(req.mrope, start, end)], self.device))
        if not req.spans or not self.model.args.images_bidirectional:
            return batch
        mask = image_mask(req.spans, start, end, self.device)
        return dataclasses.replace(batch, mask=batch.mask | mask, bidirectional=True) if mask is not None else batch

    def _inputs(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input: its ids (_ids), or on rank 0 where a chunk holds image positions, their embeddings
        with those rows replaced by the vision tower's (vision.image_rows)."""
        ids = self._ids(last_tokens, chunks)
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

    def _ids(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input ids as one sequence: decode rows' last tokens, then each chunk's prompt tokens."""
        if not self.needs_ids:
            return None
        return torch.tensor([[*last_tokens, *(t for _, req, start, end in chunks for t in req.prompt[start:end])]],
                            device=self.device)

    def _finish(self, chunks: list[PromptPart]) -> list[int]:
        """Advance each chunk's request to its end (publishing its new full blocks); the indices of the chunks
        that completed their prompt."""
        for _, req, _, end in chunks:
            req.length = end
            self._publish(req)
        return [j for j, (_, req, _, end) in enumerate(chunks) if end == len(req.prompt)]

    def _decode(self) -> list[TokenOut]:
        self._enter_phase(PHASES[self.kind, StepKind.DECODE], "decode")
        batch, last_tokens, rows = self._decode_rows()
        ids = torch.tensor(last_tokens, device=self.device).unsqueeze(1) if self.needs_ids else None
        logits = self._forward(ids, batch, (len(last_tokens), 1))
        decoding = self._advance(rows)
        if logits is not None and len(rows) < len(last_tokens):
            logits = logits[rows]
        outs = self._accept(logits, decoding) if logits is not None else []
        self._share_tokens(decoding, outs, decode=True)
        return outs


    def _decode_rows(self) -> tuple[StepBatch, list[int], list[int]]:
        """A decode row per running request of this step's rows (the header's; all of them in the plain schedule):
        the batch, each row's input token (a row still being prefilled has none yet: any id will do, its output is
        dropped) and the indices, within the batch, of the rows that sample."""
        start, end = self._step_rows or (0, len(self._running))
        running = self._running[start:end]
        width = max(len(r.table) for r in running)
        tables = torch.tensor([r.table + [0] * (width - len(r.table)) for r in running], dtype=torch.int32,
                              device=self.device)
        batch = StepBatch.build(torch.tensor([[r.length] for r in running], device=self.device), tables,
                                kv_len=max(r.length for r in running) + 1, local=self._local_tables(running),
                                rope=rope_rows([(r.mrope, r.length, r.length + 1) for r in running], self.device))
        rows = [i for i, r in enumerate(running) if r.length >= len(r.prompt)]
        return batch, [max(r.last_token, 0) for r in running], rows

    def _local_tables(self, running: list[Request]) -> torch.Tensor | None:
        """A hybrid model's sliding tables of the rows, padded like the full group's (None: one group)."""
        if self.local_blocks is None:
            return None
        width = max(len(r.local) for r in running)
        return torch.tensor([r.local + [0] * (width - len(r.local)) for r in running], dtype=torch.int32,
                            device=self.device)

    def _advance(self, rows: list[int]) -> list[Request]:
        """The requests of the sampling rows (indices within this step's rows), each one position further along."""
        start = self._step_rows[0] if self._step_rows else 0
        decoding = [self._running[start + i] for i in rows]
        for req in decoding:
            req.length += 1
        return decoding

    def _forward(
        self, ids: torch.Tensor | None, batch: StepBatch | MixedBatch, shape: tuple[int, int], *,
        last_only: bool = False
    ) -> torch.Tensor | None:
        """Run this rank's part of the forward pass; the sampler gets logits, everyone else None."""
        if ids is not None:
            x = ids
        else:
            x = self.link.recv_hidden((*shape, self.model.args.hidden_size), self.model.args.dtype, self.device)
        out = self.model(x, batch, self.cache, last_only=last_only)
        if self.kind == "pipeline" and not self.is_sampler:
            self.link.send_hidden(out)
            return None
        return out if self.is_sampler else None

    def _share_tokens(self, reqs: list[Request], outs: list[TokenOut], *, decode: bool = False) -> None:
        """Get [token, finished, failed] per row from the sampler to the ranks that embed the next input: now, or
        for rank 0 of a pipelined group when it needs them (flight.py). decode: a decode step alone (its tokens'
        trip is the group's pace, flight.Pace)."""
        if not reqs:
            return
        rows: TokenRows | None = None
        if self.is_sampler:
            rows = [[0, 1, 1] if o.error else [o.token_id, int(o.finish_reason is not None), 0] for o in outs]
        pending = self.link.exchange_tokens(rows, len(reqs))
        if pending is not None:
            self._fly(reqs, pending, decode)

    def _accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping: text, finish and per-request failure (requests.py)."""
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
