"""The transformers fallback: a decoder family the torch engine has no native file for, run by transformers' own
modeling code on one rank (vLLM's Transformers backend is the anchor).

Correct but slower than the native families: each request keeps the cache transformers makes for its model (a
DynamicCache, or a hybrid's own: Qwen3-Next's linear-attention state, Nemotron-H's Mamba state), and every
running request decodes in its own forward pass, one after another, since those caches do not batch. What the
fallback shares with the native engine is everything after the logits: sampling, stops, log-probabilities,
grammars (JSON, forced tool calls) and reasoning budgets (requests.py), the chat template (tokenizer.py), and the
runner's events. It runs on one node only: placement refuses to split a fallback family over torch ranks
(master/engine_choice.torch_splits), and the card says which runtime runs it (ModelCard.torch_runtime).

The families that need a cluster and have no native file yet (MiniMax M2, Nemotron-H, ...) are accepted on a
Linux node this way, one node each; native family files (engines/torch/models/, issue 40: GLM-4 MoE, DeepSeek V3,
gpt-oss, Qwen3-Next so far) replace this path family by family.
"""

from __future__ import annotations

import functools
import secrets
from collections import deque
from pathlib import Path
from typing import Any

import torch

from skulk.engines.base import TokenOut
from skulk.engines.constrained import Grammars, tool_call_style
from skulk.engines.errors import check_prompt
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.runners import RunnerPhase

from .core import WARMUP_ID, PhaseHook
from .requests import FaultHook, Request, accept_each, held_for_reasoning, reasoning_budget, row_sampling
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .wire import Admitted, Released, RequestEvent, Started

DEFAULT_MAX_SEQ = 4096
DEFAULT_MAX_BATCH = 8
"""Running requests at once; the rest wait. Each decodes in its own forward pass, so a larger batch only
spreads the same compute thinner."""


class FallbackEngine:
    """The Engine protocol over a transformers AutoModelForCausalLM on one rank."""

    share_prefixes = False
    wait_s = 0.0
    """No peers to wait on: one rank."""

    def __init__(self, model_dir: Path, *, max_seq: int | None = None, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto",
                                                               local_files_only=True).eval()
        config = self.model.config
        text = getattr(config, "text_config", None) or config
        self.model_type = str(getattr(config, "model_type", ""))
        self.vocab_size = int(text.vocab_size)
        positions = int(getattr(text, "max_position_embeddings", 0) or DEFAULT_MAX_SEQ)
        self.context_length = min(positions, max_seq if max_seq is not None else DEFAULT_MAX_SEQ)
        self.tokenizer = ChatTokenizer(model_dir)
        self.max_batch = max_batch
        self.on_phase: PhaseHook | None = None
        self.fault_hook: FaultHook | None = None
        self.closed = False
        self._pending: deque[Request] = deque()
        self._running: list[Request] = []
        self._caches: dict[str, Any] = {}  # request id -> the cache transformers returned for it
        self._cancels: list[str] = []
        self._releases: list[tuple[str, bool, bool]] = []  # (request_id, cancelled, failed), at the next step
        self._events: list[RequestEvent] = []
        self._warming = False
        self._phase: RunnerPhase = "idle"
        self._unseeded = torch.Generator().manual_seed(secrets.randbits(63))

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, template_kwargs)

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = ""
    ) -> None:
        check_prompt(prompt_ids, self.context_length)
        if any(r.request_id == request_id for r in (*self._pending, *self._running)):
            raise ValueError(f"request {request_id!r} is already running")
        req = self._new_request(request_id, list(prompt_ids), sampling, command_id)
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        self._pending.append(req)
        if request_id != WARMUP_ID:
            self._events.append(Admitted(request_id, command_id, len(prompt_ids), 0.0, tuple(prompt_ids[-8:]),
                                         sampling.constraint is not None))

    def cancel(self, request_id: str) -> None:
        """Released at the start of the next step; it yields no more tokens."""
        self._cancels.append(request_id)

    def has_work(self) -> bool:
        return bool(self._pending or self._running or self._cancels or self._releases)

    def step(self) -> list[TokenOut]:
        """Release what ended, decode one token for each running request, then prefill one waiting prompt."""
        with torch.inference_mode():
            self._apply_releases()
            outs = self._decode() if self._running else []
            if self._pending and len(self._running) < self.max_batch:
                outs += self._prefill(self._pending.popleft())
        if not self._running and not self._pending:
            self._enter_phase("idle", "no_work")
        return outs

    def warmup(self) -> None:
        """Generate two tokens of a throwaway request, so the first real one pays for no lazy initialisation."""
        self._warming = True
        prompt = self.tokenizer.encode("warmup") or [0]
        self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()

    # --- extras for the runner -----------------------------------------------------------------------------

    def take_events(self) -> list[RequestEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self.closed = True

    # --- requests ------------------------------------------------------------------------------------------

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        style = tool_call_style(self.model_type, self.tokenizer.renders_tools, self.tokenizer.template_text,
                                self.tokenizer.card_tool_parser)
        return Grammars(self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_ids, style)

    def _new_request(self, request_id: str, prompt: list[int], s: SamplingParams, command_id: str) -> Request:
        row = row_sampling(s, self.vocab_size, torch.device("cpu"), self._unseeded)
        constraint = self.grammars.matcher(s.constraint) if s.constraint is not None else None
        constraint, held, gate = held_for_reasoning(constraint, prompt, self.tokenizer)
        return Request(request_id, prompt, s.max_tokens, row, IncrementalDecoder(self.tokenizer.decode),
                       StopMatcher(s.stop), command_id=command_id, constraint=constraint, held=held, gate=gate,
                       budget=reasoning_budget(s, prompt, self.tokenizer))

    def _apply_releases(self) -> None:
        releases = [(rid, True, False) for rid in self._cancels] + self._releases
        self._cancels, self._releases = [], []
        for request_id, cancelled, failed in releases:
            self._release(request_id, cancelled, failed)

    def _release(self, request_id: str, cancelled: bool, failed: bool) -> None:
        """Drop the request wherever it is (the queue or the running rows) and its cache."""
        found = next((r for r in (*self._pending, *self._running) if r.request_id == request_id), None)
        if found is None:
            return
        if found in self._pending:
            self._pending.remove(found)
        else:
            self._running.remove(found)
        self._caches.pop(request_id, None)
        if request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(request_id, found.command_id, cancelled, failed))

    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    # --- compute -------------------------------------------------------------------------------------------

    def _prefill(self, req: Request) -> list[TokenOut]:
        """The whole prompt in one forward pass (a fresh cache of the model's own kind), then its first token."""
        self._enter_phase("prefill_stream", "prefill")
        if req.request_id != WARMUP_ID:
            self._events.append(Started(req.request_id, req.command_id, 0))
        logits = self._forward(req, req.prompt)
        req.length = len(req.prompt)
        self._running.append(req)
        return self._accept(logits, req)

    def _decode(self) -> list[TokenOut]:
        """One token for every running request, each in its own forward pass over its own cache."""
        self._enter_phase("decode_stream", "decode")
        outs: list[TokenOut] = []
        for req in list(self._running):
            logits = self._forward(req, [req.last_token])
            req.length += 1
            outs += self._accept(logits, req)
        return outs

    def _forward(self, req: Request, ids: list[int]) -> torch.Tensor:
        """The last position's logits (float32, one row) for these ids after the request's cached past."""
        out = self.model(input_ids=torch.tensor([ids]), cache=self._caches.get(req.request_id), use_cache=True,
                         logits_to_keep=1)
        self._caches[req.request_id] = out.cache
        return out.logits[0, -1:].float()

    def _accept(self, logits: torch.Tensor, req: Request) -> list[TokenOut]:
        """The native engine's sampling and detokenising (requests.accept_each); a finished request leaves at
        the start of the next step, as the runner expects."""
        outs = accept_each(logits, [req], self.tokenizer.eos_ids, self.context_length, self.fault_hook)
        for out in outs:
            if out.finish_reason is not None or out.error:
                req.finished = True
                self._releases.append((req.request_id, False, bool(out.error)))
        return outs
