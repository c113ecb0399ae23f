"""The transformers fallback: a decoder family the torch engine has no native file for, run by transformers' own
modeling code (vLLM's Transformers backend is the anchor), on one rank or as a Pipeline split by decoder layers.

Correct but slower than the native families: each request keeps the cache transformers makes for its model (a
DynamicCache, or a hybrid's own: Nemotron-H's Mamba state, Gemma 4's sliding layers), and every running request
decodes in its own forward pass, one after another, since those caches do not batch. What the fallback shares with
the native engine is everything after the logits: sampling, stops, log-probabilities, grammars (JSON, forced tool
calls) and reasoning budgets (requests.py), the chat template (tokenizer.py), the step header and the link to the
other ranks (wire.py, links.py), and the runner's events.

A Pipeline rank holds only its decoder layers (fallback_stage.py builds them without ever holding the rest). Rank 0
schedules: each step it sends a header (wire.Header: the step's adds and releases) and every rank applies it to
the same queue and running list, then runs the same forwards in the same order: every running request's next
token, then the first waiting prompt while there is room. Hidden states go rank to rank per forward; the last rank
samples and broadcasts each forward's [token, finished, failed] to every rank, so every rank knows every request's
tokens and rank 0 turns the finished ones into the next header's releases. Nothing runs ahead: the fallback waits
on each step's tokens before leading the next (its micro-batching is the native engine's).

The caches stay within what placement reserved for each rank (kv_cache_bytes): the warmup measures what a
request's cache costs on each rank (fallback_stage.CacheCost: fixed state plus bytes a position), the ranks share
those, and rank 0 admits a waiting prompt only while every rank's caches, each request counted at its prompt plus
max_tokens, still fit (the header's `chunk` says admit); a request that could never fit is refused when added.

A Tensor split is refused by placement (master/engine_choice.torch_splits), as is a Pipeline of a family whose
layers read the token ids beside the hidden states (Gemma 4's per-layer inputs); the card says which runtime runs
the family (ModelCard.torch_runtime) and whether its fallback splits (ModelCard.fallback_splits).

The families that need a cluster and have no native file yet (MiniMax M2, Nemotron-H, Mixtral, Llama 4, Gemma 4)
run this way; native family files (engines/torch/models/) replace this path family by family.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skulk.engines.base import GROUP_STEP_HEARTBEAT_S, TokenOut
from skulk.engines.constrained import Grammars, tool_call_style
from skulk.engines.errors import PromptRejected, check_prompt
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.runners import RunnerPhase

from .core import WARMUP_ID, PhaseHook
from .fallback_stage import (
    CacheCost,
    StageSpan,
    forward_stage,
    hidden_size,
    layer_bytes,
    layer_count,
    load_stage,
    stage_cache,
)
from .links import GroupLink, Link, LocalLink, TokenRows
from .pace import module_bytes
from .requests import FaultHook, Request, accept_each, held_for_reasoning, reasoning_budget, row_sampling
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .wire import Admitted, Header, NewRequest, Release, Released, RequestEvent, Started, StepKind

DEFAULT_MAX_SEQ = 4096
DEFAULT_MAX_BATCH = 8
"""Running requests at once; the rest wait. Each decodes in its own forward pass, so a larger batch only
spreads the same compute thinner."""


class FallbackEngine:
    """The Engine protocol over a transformers causal LM, or this rank's stage of it (module docstring)."""

    share_prefixes = False

    def __init__(self, model_dir: Path, *, max_seq: int | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 rank: int = 0, world_size: int = 1, start_layer: int = 0, end_layer: int | None = None,
                 control_group: Any = None, kv_cache_bytes: int | None = None) -> None:
        """rank, world_size, start_layer, end_layer, control_group: this rank's place in a Pipeline (the torch
        engine's own names, options.Shard); the defaults are one rank with every layer. kv_cache_bytes: what
        placement reserved for this rank's caches (None: no bound but max_batch and the context)."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        total = layer_count(model_dir)
        self.span = StageSpan(start_layer, total if end_layer is None else end_layer, rank == 0,
                              rank == world_size - 1)
        self.model: Any = load_stage(model_dir, self.span)
        text = self.model.config.get_text_config(decoder=True)
        self.model_type = str(getattr(self.model.config, "model_type", ""))
        self.vocab_size, self.hidden_size = int(text.vocab_size), hidden_size(self.model)
        positions = int(getattr(text, "max_position_embeddings", 0) or DEFAULT_MAX_SEQ)
        self.context_length = min(positions, max_seq if max_seq is not None else DEFAULT_MAX_SEQ)
        self.tokenizer = ChatTokenizer(model_dir)
        self.max_batch, self.rank, self.world_size = max_batch, rank, world_size
        self.is_scheduler, self.is_sampler = self.span.first, self.span.last
        self.link: Link = LocalLink() if world_size == 1 else GroupLink(rank, world_size, "pipeline", control_group)
        self.on_phase: PhaseHook | None = None
        self.fault_hook: FaultHook | None = None
        self.closed = False
        self._pending: deque[Request] = deque()
        self._running: list[Request] = []
        self._caches: dict[str, Any] = {}  # request id -> this stage's transformers cache for it
        self._adds: list[tuple[NewRequest, Request]] = []  # rank 0: added since the last header
        self.kv_cache_bytes = kv_cache_bytes
        self.costs: list[CacheCost] = []
        """Every rank's cache cost and budget, measured at warmup and shared (rank 0 admits by them)."""
        self._sizes: list[tuple[int, list[tuple[int, int]]]] = []  # the warmup's (positions, layer_bytes)
        self._cancels: list[str] = []
        self._releases: list[Release] = []  # rank 0: what ended, released by the next header
        self._events: list[RequestEvent] = []
        self._warming = False
        self._last_header = time.monotonic()
        self._phase: RunnerPhase = "idle"
        self._unseeded = torch.Generator().manual_seed(secrets.randbits(63))

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, template_kwargs)

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = ""
    ) -> None:
        """Rank 0: queued for the next header, which every rank applies."""
        check_prompt(prompt_ids, self.context_length)
        need = min(len(prompt_ids) + sampling.max_tokens, self.context_length)
        if (short := next((c for c in self.costs if not c.holds([], need)), None)) is not None:
            raise PromptRejected(f"this request may grow to {need} tokens of cache ({short.bytes_for(need)} bytes on "
                                 f"rank {short.rank}), more than the {short.budget} bytes this instance reserved "
                                 "there: ask for fewer max_tokens or send a shorter prompt")
        if any(r.request_id == request_id for r in (*self._pending, *self._running, *(q for _, q in self._adds))):
            raise ValueError(f"request {request_id!r} is already running")
        req = self._new_request(request_id, list(prompt_ids), sampling, command_id)
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        self._adds.append((NewRequest.of(request_id, command_id, list(prompt_ids), sampling), req))

    def cancel(self, request_id: str) -> None:
        """Released by the next header; it yields no more tokens."""
        self._cancels.append(request_id)

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or (in a group) a heartbeat is due. Others: always, until
        shutdown, because they must be inside step() whenever rank 0 sends."""
        if not self.is_scheduler:
            return not self.closed
        if self._pending or self._running or self._adds or self._cancels or self._releases:
            return True
        return self.world_size > 1 and time.monotonic() - self._last_header >= GROUP_STEP_HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        """One header (led by rank 0, followed by the others) and the forwards it implies (module docstring)."""
        with torch.inference_mode():
            header, built = self._lead() if self.is_scheduler else (self.link.receive_header(), {})
            self._apply(header, built)
            if header.kind == StepKind.SHUTDOWN:
                self.closed = True
            outs = self._run(bool(header.chunk)) if header.kind == StepKind.DECODE else []
        if not self._running and not self._pending:
            self._enter_phase("idle", "no_work")
        return outs

    def warmup(self) -> None:
        """Two tokens of a throwaway request through every rank, so the first real one pays for no lazy
        initialisation and a group's connections are exercised."""
        self._warming = True
        if self.is_scheduler:
            prompt = self.tokenizer.encode("warmup") or [0]
            self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()
        self._share_costs()

    def _share_costs(self) -> None:
        """Each rank's cost of a request's cache (from the warmup's sizes) and its budget, gathered on every rank:
        rank 0 admits a prompt only where every rank's caches still fit (CacheCost)."""
        own = CacheCost.measured(self.rank, self._sizes[0], self._sizes[-1], self.kv_cache_bytes)
        if self.world_size == 1:
            self.costs = [own]
            return
        mine = torch.tensor([own.fixed, own.per_token, own.windowed, own.window, own.budget], dtype=torch.int64)
        every = [torch.empty(5, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=getattr(self.link, "control_group", None))
        self.costs = [CacheCost(r, *(int(v) for v in t.tolist())) for r, t in enumerate(every)]

    # --- extras for the runner -----------------------------------------------------------------------------

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting on peers since the runner last took it (tracing)."""
        return self.link.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self.link.wait_s = value

    def take_events(self) -> list[RequestEvent]:
        events, self._events = self._events, []
        return events

    def footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes resident from allocation): this stage's tensors, and no pool (each request's
        cache grows with it). The runner reports the rest of its memory as runtime overhead, which placement
        counts (types/node_info.RunnerOverhead)."""
        return module_bytes(self.model), 0

    def close(self) -> None:
        """Rank 0 tells everyone to leave (with any last releases); a dead peer no longer matters here."""
        if self.is_scheduler and not self.closed and self.world_size > 1:
            try:
                self.link.send_header(Header(StepKind.SHUTDOWN, (), self._take_releases()))
                self.link.flush()
            except RuntimeError:
                pass
        self.closed = True

    # --- headers -------------------------------------------------------------------------------------------

    def _lead(self) -> tuple[Header, dict[str, Request]]:
        """Rank 0: the next header from what was added, cancelled and finished, sent to the others, and its adds'
        requests as add_request built them."""
        adds, self._adds = self._adds, []
        releases = self._take_releases()
        gone = {r.request_id for r in releases}
        running = [r for r in self._running if r.request_id not in gone]
        queue = [r for r in (*self._pending, *(req for _, req in adds)) if r.request_id not in gone]
        admit = bool(queue) and len(running) < self.max_batch and (not running or all(  # alone: it fits (add_request)
            c.holds([self._need(r) for r in running], self._need(queue[0])) for c in self.costs))
        work = bool(queue or running)
        header = Header(StepKind.DECODE if work else StepKind.HEARTBEAT, tuple(a for a, _ in adds), releases,
                        chunk=int(admit))
        self.link.send_header(header)
        self._last_header = time.monotonic()
        return header, {a.request_id: req for a, req in adds}

    def _need(self, req: Request) -> int:
        """Positions the request's cache may grow to: its prompt and every token it may generate."""
        return min(len(req.prompt) + req.max_tokens, self.context_length)

    def _take_releases(self) -> tuple[Release, ...]:
        releases = tuple(Release(rid, True) for rid in self._cancels) + tuple(self._releases)
        self._cancels, self._releases = [], []
        return releases

    def _apply(self, header: Header, built: dict[str, Request]) -> None:
        """The header's releases, then its adds (to the queue), on every rank alike; rank 0 queues the requests it
        built when they were added (`built`), the others build them from the header."""
        for release in header.releases:
            self._release(release)
        for add in header.adds:
            s = add.sampling_params()
            req = built.get(add.request_id) or self._new_request(add.request_id, add.prompt, s, add.command_id)
            self._pending.append(req)
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt), time.perf_counter(),
                                             tuple(add.prompt[-8:]), s.constraint is not None))

    # --- requests ------------------------------------------------------------------------------------------

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The compiler of constrained requests' grammars for this model's vocabulary, built on first use."""
        style = tool_call_style(self.model_type, self.tokenizer.renders_tools, self.tokenizer.template_text,
                                self.tokenizer.card_tool_parser)
        return Grammars(self.tokenizer.hf, self.vocab_size, self.tokenizer.eos_ids, style)

    def _new_request(self, request_id: str, prompt: list[int], s: SamplingParams, command_id: str) -> Request:
        """A request's state; its grammar and reasoning budget where this rank checks or samples them."""
        row = row_sampling(s, self.vocab_size, torch.device("cpu"), self._unseeded)
        checks = self.is_sampler or self.is_scheduler
        constraint = self.grammars.matcher(s.constraint) if s.constraint is not None and checks else None
        constraint, held, gate = held_for_reasoning(constraint, prompt, self.tokenizer)
        budget = reasoning_budget(s, prompt, self.tokenizer) if self.is_sampler else None
        return Request(request_id, prompt, s.max_tokens, row, IncrementalDecoder(self.tokenizer.decode),
                       StopMatcher(s.stop), command_id=command_id, constraint=constraint, held=held, gate=gate,
                       budget=budget)

    def _release(self, release: Release) -> None:
        """Drop the request wherever it is (the queue or the running rows) and its cache."""
        request_id = release.request_id
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
            self._events.append(Released(request_id, found.command_id, release.cancelled, release.failed))

    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    # --- compute -------------------------------------------------------------------------------------------

    def _run(self, admit: bool) -> list[TokenOut]:
        """One token for every running request, each in its own forward pass over its own cache, then, where rank
        0 admitted it (a free row, and every rank's caches still fit: CacheCost), the first waiting prompt in one
        forward pass (a fresh cache of the model's own kind); then the step's tokens, shared."""
        stepped, outs = list(self._running), []
        if stepped:
            self._enter_phase("decode_stream", "decode")
        for req in stepped:
            outs += self._forward(req, [req.last_token], req.length)
            req.length += 1
        if admit and self._pending:
            self._enter_phase("prefill_stream", "prefill")
            req = self._pending.popleft()
            if req.request_id != WARMUP_ID:
                self._events.append(Started(req.request_id, req.command_id, 0))
            self._caches[req.request_id] = stage_cache(self.model, self.span)
            outs += self._forward(req, req.prompt, 0)
            req.length = len(req.prompt)
            self._running.append(req)
            stepped.append(req)
        self._take_tokens(stepped, outs)
        return outs if self.is_sampler else []

    def _forward(self, req: Request, ids: list[int], start: int) -> list[TokenOut]:
        """This stage's part of one forward: from ids or the previous rank's hidden states, to the next rank's
        or, on the last, to the request's next token (requests.accept_each: the native engine's sampling)."""
        x = torch.tensor([ids])
        hidden = None if self.span.first else self.link.recv_hidden((1, len(ids), self.hidden_size),
                                                                     self.model.dtype, torch.device("cpu"))
        cache = self._caches[req.request_id]
        out = forward_stage(self.model, self.span, x, hidden, cache, start)
        if req.request_id == WARMUP_ID:
            self._sizes.append((start + len(ids), layer_bytes(cache, self.span)))
        if not self.span.last:
            self.link.send_hidden(out)
            return []
        return accept_each(out, [req], self.tokenizer.eos_ids, self.context_length, self.fault_hook)

    def _take_tokens(self, stepped: list[Request], outs: list[TokenOut]) -> None:
        """Every rank learns each forward's [token, finished, failed] from the sampler; rank 0 releases the
        finished ones with its next header."""
        rows: TokenRows | None = None
        if self.is_sampler:
            rows = [[o.token_id, int(o.finish_reason is not None or bool(o.error)), int(bool(o.error))]
                    for o in outs]
        if self.world_size > 1:
            wire = (torch.tensor(rows, dtype=torch.int64).reshape(-1, 3) if rows is not None
                    else torch.empty((len(stepped), 3), dtype=torch.int64))
            started = time.perf_counter()
            dist.broadcast(wire, src=self.world_size - 1, group=getattr(self.link, "control_group", None))
            self.link.wait_s += time.perf_counter() - started
            rows = wire.tolist()
        assert rows is not None and len(rows) == len(stepped)
        for req, (token, finished, failed) in zip(stepped, rows, strict=True):
            req.last_token = token
            if finished:
                req.finished = True
                if self.is_scheduler:
                    self._releases.append(Release(req.request_id, False, bool(failed)))
