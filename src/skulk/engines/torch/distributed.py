"""DistributedEngine: one rank of a Pipeline or Tensor instance, driven step by step by rank 0.

Rank 0 is the scheduler. The rule, on every rank, is: one step() = one header from rank 0, then exactly the
work that header names. Rank 0 turns queued add_request/cancel calls into the header's adds and releases,
applies them to its own state, decides the step kind from the result (prefill the first pending request if a
slot is free, else decode every running request, else a heartbeat when one is due) and broadcasts it; every
other rank applies the same header to the same state, so pending queues, running lists and KV-cache slot
moves stay identical everywhere without further agreement. On the other ranks add_request/cancel are no-ops
and step() blocks until the next header: it is the header that admits and releases their requests.

Pipeline: rank r owns [start_layer, end_layer); rank 0 embeds, hidden states go rank to rank with send/recv
(shapes follow from the shared state), the last rank samples and sends [token, finished] per row back to rank
0, which needs them for the next decode input and for releasing finished requests. Tensor: every rank runs
all layers on its head/column shard with a real all_reduce; the last rank samples and broadcasts the tokens.
The last rank (the sampler) is the only one whose step() returns TokenOuts; the rest return [].
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from skulk.engines.base import TokenOut
from skulk.engines.errors import ContextLengthExceeded
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.runners import RunnerPhase

from .cache import StepBatch
from .engine import DEFAULT_MAX_SEQ
from .loader import load_model
from .requests import FaultHook, Request, accept_each, row_sampling
from .tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from .wire import Admitted, Header, HeaderChannel, NewRequest, Release, Released, RequestEvent, StepKind

HEARTBEAT_S = 0.5
WARMUP_ID = "__skulk_warmup__"
ShardKind = Literal["pipeline", "tensor"]
PhaseHook = Callable[[RunnerPhase, str], None]

_PHASES: dict[tuple[str, StepKind], RunnerPhase] = {
    ("pipeline", StepKind.PREFILL): "prefill_pipeline",
    ("pipeline", StepKind.DECODE): "decode_stream",
    ("tensor", StepKind.PREFILL): "prefill_barrier",
    ("tensor", StepKind.DECODE): "decode_barrier",
}


def _tensor_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


class DistributedEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        rank: int,
        world_size: int,
        kind: ShardKind,
        start_layer: int = 0,
        end_layer: int | None = None,
        control_group: Any = None,
        max_batch: int = 8,
        max_seq: int | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantize: str | None = None,
    ) -> None:
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.device = torch.device(device)
        tensor = kind == "tensor"
        self.model = load_model(
            model_dir, start_layer=0 if tensor else start_layer, end_layer=None if tensor else end_layer,
            tp_rank=rank if tensor else 0, tp_size=world_size if tensor else 1,
            all_reduce=_tensor_all_reduce if tensor else None, dtype=dtype, device=self.device, quantize=quantize,
        )
        positions = self.model.args.max_position_embeddings
        self.context_length = min(positions, max_seq if max_seq is not None else DEFAULT_MAX_SEQ)
        self.max_batch = max_batch
        self.cache = self.model.make_cache(max_batch, self.context_length)
        self.tokenizer = ChatTokenizer(model_dir)
        self.is_scheduler, self.is_sampler = rank == 0, rank == world_size - 1
        self.needs_ids = tensor or rank == 0  # who embeds token ids
        self.channel = HeaderChannel(control_group)
        self.control_group = control_group
        self.on_phase: PhaseHook | None = None
        self.wait_s = 0.0
        """Seconds spent waiting on peers (pipeline recv, token share) since the runner last took it (tracing)."""
        self.closed = False
        self._pending: deque[Request] = deque()
        self._running: list[Request] = []  # index == cache slot, identical on every rank
        self._adds: list[NewRequest] = []  # rank 0: for the next header
        self._releases: list[Release] = []  # rank 0: for the next header
        self._events: list[RequestEvent] = []
        self._phase: RunnerPhase = "idle"
        self._last_header = 0.0
        self._warming = False
        self._unseeded = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))
        self.fault_hook: FaultHook | None = None

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools)

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = ""
    ) -> None:
        """Rank 0 queues the request for the next header; on other ranks this is a no-op."""
        if not self.is_scheduler:
            return
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) > self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), self.context_length)
        known = {r.request_id for r in (*self._pending, *self._running)} | {a.request_id for a in self._adds}
        if request_id in known:
            raise ValueError(f"request {request_id!r} is already running")
        add = NewRequest.of(request_id, command_id, list(prompt_ids), sampling)
        req = self._new_request(add)  # what every rank will build from the header: if it raises, it does here
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        self._adds.append(add)

    def cancel(self, request_id: str) -> None:
        """Rank 0 releases the request in the next header (every rank then frees it); elsewhere a no-op."""
        if not self.is_scheduler:
            return
        before = len(self._adds)
        self._adds = [a for a in self._adds if a.request_id != request_id]
        if len(self._adds) == before:
            self._releases.append(Release(request_id, cancelled=True))

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or a heartbeat is due. Others: always, until shutdown,
        because they must be inside step() whenever rank 0 broadcasts."""
        if not self.is_scheduler:
            return not self.closed
        if self._pending or self._running or self._adds or self._releases:
            return True
        return time.monotonic() - self._last_header >= HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        with torch.inference_mode():
            header = self._lead() if self.is_scheduler else self._follow()
            if header.kind == StepKind.PREFILL:
                return self._prefill()
            if header.kind == StepKind.DECODE:
                return self._decode()
            if header.kind == StepKind.SHUTDOWN:
                self.closed = True
            self._enter_phase("idle", "heartbeat")
            return []

    def warmup(self) -> None:
        """Collective: rank 0 generates two tokens of a throwaway request, every rank steps until the header
        releases it, so each rank has run its layers and the group's connections are exercised."""
        self._warming = True
        if self.is_scheduler:
            prompt = self.tokenizer.encode("warmup") or [0]
            self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()

    # --- extras for the runner -----------------------------------------------------------------------------

    def take_events(self) -> list[RequestEvent]:
        """Requests admitted and released by the headers since the last call (cheap when nothing happened)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Rank 0 tells everyone to leave (with any last releases); a dead peer no longer matters here."""
        if self.is_scheduler and not self.closed:
            self.closed = True
            try:
                self.channel.send(Header(StepKind.SHUTDOWN, (), tuple(self._releases)))
            except RuntimeError:
                pass
        self.closed = True

    # --- headers -------------------------------------------------------------------------------------------

    def _lead(self) -> Header:
        header = Header(StepKind.HEARTBEAT, tuple(self._adds), tuple(self._releases))
        self._adds, self._releases = [], []
        self._apply(header)
        if self._pending and len(self._running) < self.max_batch:
            kind = StepKind.PREFILL
        elif self._running:
            kind = StepKind.DECODE
        else:
            kind = StepKind.HEARTBEAT
        header = Header(kind, header.adds, header.releases)
        self.channel.send(header)
        self._last_header = time.monotonic()
        return header

    def _follow(self) -> Header:
        header = self.channel.receive()
        self._apply(header)
        return header

    def _apply(self, header: Header) -> None:
        for release in header.releases:
            self._release(release)
        for add in header.adds:
            self._pending.append(self._new_request(add))
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt)))

    def _new_request(self, add: NewRequest) -> Request:
        s = add.sampling_params()
        row = row_sampling(s, self.model.args.vocab_size, self.device, self._unseeded)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        stops = StopMatcher(s.stop)
        return Request(add.request_id, add.prompt, s.max_tokens, row, decoder, stops, command_id=add.command_id)

    def _release(self, release: Release) -> None:
        """Drop a pending request, or free a running one's slot by moving the last running request into it."""
        found = next((r for r in self._pending if r.request_id == release.request_id), None)
        if found is not None:
            self._pending.remove(found)
        else:
            slot = next((i for i, r in enumerate(self._running) if r.request_id == release.request_id), None)
            if slot is None:
                return
            found = self._running[slot]
            last = self._running.pop()
            if slot < len(self._running):
                self._running[slot] = last
                self.cache.move_slot(len(self._running), slot, last.length)
        if found.request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(found.request_id, found.command_id, release.cancelled, release.failed))

    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    # --- compute -------------------------------------------------------------------------------------------

    def _prefill(self) -> list[TokenOut]:
        self._enter_phase(_PHASES[self.kind, StepKind.PREFILL], "prefill")
        req = self._pending.popleft()
        slot = len(self._running)
        self._running.append(req)
        n = len(req.prompt)
        positions = torch.arange(n, device=self.device).unsqueeze(0)
        batch = StepBatch.build(positions, slot, kv_len=n)
        ids = torch.tensor([req.prompt], device=self.device) if self.needs_ids else None
        logits = self._forward(ids, batch, (1, n), last_only=True)
        req.length = n
        outs = self._accept(logits, [req]) if logits is not None else []
        if self.is_scheduler and self.kind == "pipeline":
            self._enter_phase("decode_wait_first_token", "prefill_sent")
        self._share_tokens([req], outs)
        return outs

    def _decode(self) -> list[TokenOut]:
        self._enter_phase(_PHASES[self.kind, StepKind.DECODE], "decode")
        running = self._running
        positions = torch.tensor([[r.length] for r in running], device=self.device)
        batch = StepBatch.build(positions, 0, kv_len=max(r.length for r in running) + 1)
        ids = torch.tensor([[r.last_token] for r in running], device=self.device) if self.needs_ids else None
        logits = self._forward(ids, batch, (len(running), 1))
        for req in running:
            req.length += 1
        outs = self._accept(logits, running) if logits is not None else []
        self._share_tokens(running, outs)
        return outs

    def _forward(
        self, ids: torch.Tensor | None, batch: StepBatch, shape: tuple[int, int], *, last_only: bool = False
    ) -> torch.Tensor | None:
        """Run this rank's part of the forward pass; the sampler gets logits, everyone else None."""
        if ids is not None:
            x = ids
        else:
            hidden = self.model.args.hidden_size
            x = torch.empty((*shape, hidden), dtype=self.model.args.dtype, device=self.device)
            started = time.perf_counter()
            dist.recv(x, src=self.rank - 1)
            self.wait_s += time.perf_counter() - started
        out = self.model(x, batch, self.cache, last_only=last_only)
        if self.kind == "pipeline" and not self.is_sampler:
            dist.send(out.contiguous(), dst=self.rank + 1)
            return None
        return out if self.is_sampler else None

    def _share_tokens(self, reqs: list[Request], outs: list[TokenOut]) -> None:
        """Get [token, finished, failed] per row from the sampler to the ranks that embed the next input. A row
        that failed on the sampler is finished too: rank 0 releases it in the next header, so every rank frees
        its slot, while its batch-mates go on."""
        if self.kind == "pipeline" and not (self.is_sampler or self.is_scheduler):
            return
        wire = torch.empty((len(reqs), 3), dtype=torch.int64)
        if self.is_sampler:
            rows = [[0, 1, 1] if o.error else [o.token_id, o.finish_reason is not None, 0] for o in outs]
            wire = torch.tensor(rows, dtype=torch.int64)
        started = time.perf_counter()
        if self.kind == "tensor":
            dist.broadcast(wire, src=self.world_size - 1, group=self.control_group)
        elif self.is_sampler:
            dist.send(wire, dst=0, group=self.control_group)
            return
        else:
            dist.recv(wire, src=self.world_size - 1, group=self.control_group)
        self.wait_s += time.perf_counter() - started
        for req, (token, finished, failed) in zip(reqs, wire.tolist(), strict=True):
            req.last_token = token
            if finished and self.is_scheduler:
                req.finished = True
                self._releases.append(Release(req.request_id, cancelled=False, failed=bool(failed)))

    def _accept(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping, exactly as TorchEngine decides text, finish and per-request failure."""
        return accept_each(logits[:, -1], reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
