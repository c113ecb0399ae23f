"""TorchEngine: the Engine protocol over a ModelSlice, with continuous batching.

Requests join between steps. Each step prefills the requests that fit into free cache slots (one forward
each), then decodes one token for every running request in a single batched forward. Running requests are
kept packed in cache slots [0, n) so the batched forward reads the cache as a view; when one finishes, the
last request moves into its slot. Not thread-safe: one runner thread drives add_request/cancel/step.
"""

from __future__ import annotations

import secrets
from collections import deque
from pathlib import Path
from typing import Any

import torch

from skulk.engines.base import TokenOut
from skulk.engines.errors import ContextLengthExceeded
from skulk.types.chat import ChatMessage, SamplingParams

from .cache import StepBatch
from .loader import load_model
from .requests import FaultHook, Request, accept_each, row_sampling
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher

DEFAULT_MAX_SEQ = 4096  # caps the preallocated cache for long-context models unless max_seq says otherwise
_WARMUP_ID = "__skulk_warmup__"


class TorchEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        start_layer: int = 0,
        end_layer: int | None = None,
        max_batch: int = 8,
        max_seq: int | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.device = torch.device(device)
        self.model = load_model(
            model_dir, start_layer=start_layer, end_layer=end_layer, dtype=dtype, device=self.device,
            quantize=quantize,
        )
        positions = self.model.args.max_position_embeddings
        self.context_length = min(positions, max_seq if max_seq is not None else DEFAULT_MAX_SEQ)
        self.max_batch = max_batch
        self.cache = self.model.make_cache(max_batch, self.context_length)
        self.tokenizer = ChatTokenizer(model_dir)
        self._pending: deque[Request] = deque()
        self._running: list[Request] = []  # index == cache slot
        self._unseeded = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))
        self.fault_hook: FaultHook | None = None

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools)

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request; it is prefilled by the next step that has a free cache slot."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), self.context_length)
        if any(r.request_id == request_id for r in (*self._pending, *self._running)):
            raise ValueError(f"request {request_id!r} is already running")
        row = row_sampling(sampling, self.model.args.vocab_size, self.device, self._unseeded)
        req = Request(
            request_id, list(prompt_ids), sampling.max_tokens, row,
            IncrementalDecoder(self.tokenizer.decode), StopMatcher(sampling.stop),
        )
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        self._pending.append(req)

    def cancel(self, request_id: str) -> None:
        self._pending = deque(r for r in self._pending if r.request_id != request_id)
        for slot, req in enumerate(self._running):
            if req.request_id == request_id:
                self._release(slot)
                return

    def has_work(self) -> bool:
        return bool(self._pending or self._running)

    def step(self) -> list[TokenOut]:
        """Prefill what fits, then decode every running request once (a request prefilled in this step
        decodes too, so it may yield two tokens); returns the tokens in the order they were produced."""
        if not (self.model.is_first and self.model.is_last):
            raise RuntimeError("step() needs the whole model; a layer slice is driven stage by stage")
        out: list[TokenOut] = []
        with torch.inference_mode():
            while self._pending and len(self._running) < self.max_batch:
                out.append(self._prefill(self._pending.popleft()))
                self._release_finished()
            if self._running:
                out.extend(self._decode())
                self._release_finished()
        return out

    def warmup(self) -> None:
        """Generate two tokens of a throwaway request, unless real work is already under way."""
        if self.has_work():
            return
        prompt = self.tokenizer.encode("warmup") or [0]
        sampling = SamplingParams(max_tokens=2, temperature=0)
        self.add_request(_WARMUP_ID, prompt[: self.context_length], sampling)
        while self.has_work():
            self.step()

    def _prefill(self, req: Request) -> TokenOut:
        slot = len(self._running)
        self._running.append(req)
        ids = torch.tensor([req.prompt], device=self.device)
        positions = torch.arange(len(req.prompt), device=self.device).unsqueeze(0)
        batch = StepBatch.build(positions, slot, kv_len=len(req.prompt))
        logits = self.model(ids, batch, self.cache, last_only=True)
        req.length = len(req.prompt)
        return self._accept(logits, [req])[0]

    def _decode(self) -> list[TokenOut]:
        running = self._running
        ids = torch.tensor([[r.last_token] for r in running], device=self.device)
        positions = torch.tensor([[r.length] for r in running], device=self.device)
        batch = StepBatch.build(positions, 0, kv_len=max(r.length for r in running) + 1)
        logits = self.model(ids, batch, self.cache)
        for req in running:
            req.length += 1
        return self._accept(logits, running)

    def _accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)

    def _release_finished(self) -> None:
        for slot in range(len(self._running) - 1, -1, -1):
            if self._running[slot].finished:
                self._release(slot)

    def _release(self, slot: int) -> None:
        """Free a slot, moving the last running request into it so slots stay packed."""
        last = self._running.pop()
        if slot < len(self._running):
            self._running[slot] = last
            self.cache.move_slot(len(self._running), slot, last.length)
