"""The work one header names, on every rank: a prefill chunk, a decode step, or both in one forward pass (MIXED).

Pipeline: rank r runs its layers and sends the hidden states on; the last rank samples and sends [token, finished,
failed] per row back to rank 0. Tensor: every rank runs all layers on its shard with a real all_reduce; the last
rank samples and broadcasts. Only the sampler's step returns TokenOuts.
"""

from __future__ import annotations

import torch

from skulk.engines.base import TokenOut
from skulk.types.runners import RunnerPhase

from .admission import Admission
from .cache import MixedBatch, StepBatch
from .executor import PromptPart
from .links import TokenRows
from .requests import Request, accept_each
from .schedule import share_chunk
from .vision import whole_images
from .wire import Header, StepKind

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
        return self.executor.chunk_batch(part, self.local_blocks is not None)

    def _inputs(self, last_tokens: list[int], chunks: list[PromptPart]) -> torch.Tensor | None:
        """The step's input ids, or on rank 0 embeddings with a chunk's image rows (Executor.inputs)."""
        return self.executor.inputs(last_tokens, chunks)

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
        batch = self.executor.decode_batch(running, self.local_blocks is not None)
        rows = [i for i, r in enumerate(running) if r.length >= len(r.prompt)]
        return batch, [max(r.last_token, 0) for r in running], rows

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
        """Run this rank's part of the forward pass (Executor.forward); the sampler gets logits, others None."""
        return self.executor.forward(ids, batch, shape, last_only=last_only)

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
            self.flights.fly(reqs, pending, decode)

    def _accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping: text, finish and per-request failure (requests.py)."""
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
