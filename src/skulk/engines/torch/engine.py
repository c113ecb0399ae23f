"""TorchEngine: one core for every world size, with a paged KV cache, continuous batching, chunked prefill, a
shared prefix cache and preemption.

One step() is one header and exactly the work it names. Rank 0 is the scheduler: it turns queued
add_request/cancel calls into the header's adds and releases, applies them to its own state, decides the step
(schedule.py: a prefill chunk, a decode, or both in one forward pass while both are wanted) and sends it;
every other rank applies the same header to the same state, so pending queues, running rows and block tables
stay identical everywhere without further agreement. A single rank (world size 1) is the same core over a
LocalLink, where sending a header costs nothing and rank 0 is also the sampler.

The KV cache is a pool of fixed-size blocks (cache.py); each request holds a block table (blocks.py), gets its
prompt's blocks when admitted and one more whenever its next position crosses into a new block, and gives them
back when it leaves. Full blocks stay cached under the chain key of their tokens, so a request whose prompt
starts with the same tokens (the next turn of a chat, a shared system prompt) shares them by reference instead
of recomputing them, even while their first owner still runs. When the pool is short, pending requests wait in
the queue (FIFO), and when a running request cannot grow, the most recently admitted one is preempted: its blocks
go back (cached, so its resumption usually finds most of them), it goes back to the head of the queue with the
tokens it generated appended to its prompt, and is recomputed when blocks free up; it never fails. A request
being prefilled holds its rows too; a decode step computes its row but samples nothing from it (the row's
key/value lands on the position its next chunk overwrites, in the same step when the chunk rides on it: MIXED).

Pipeline: rank r owns [start_layer, end_layer); hidden states go rank to rank, the last rank samples and sends
[token, finished, failed] per row back to rank 0. Tensor: every rank runs all layers on its shard with a real
all_reduce; the last rank samples and broadcasts. Only the sampler's step() returns TokenOuts.

The engine holds its parts (core.py's docstring lists them): an Executor (executor.py: the model slice, the KV
tensors, the link, a draft model), the Scheduler (scheduler.py, pure: admission, preemption, block tables) and
rank 0's steps in flight (flight.Flights). Over them the class is a stack split by concern: core (state and
construction, core.build_parts), admission (sending and applying headers), step (the forward pass of each step
kind on every rank), local_step (single-rank speculative steps), and this module (the Engine protocol and step()'s
dispatch).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from skulk.engines.base import GROUP_STEP_HEARTBEAT_S, TokenOut
from skulk.engines.errors import PromptRejected, check_prompt
from skulk.types.chat import ChatMessage, SamplingParams

from .blocks import BlockAllocator
from .core import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, WARMUP_ID, PhaseHook
from .links import GroupLink
from .local_step import LocalStep
from .vision import Tower, VisionInput, image_spans, load_tower, read_images
from .wire import Header, NewRequest, Release, RequestEvent, StepKind

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_BATCH", "DEFAULT_PREFILL_CHUNK", "PhaseHook", "TorchEngine"]


class TorchEngine(LocalStep):
    """The Engine protocol over the parts and stack in core.py's docstring; construction is EngineCore.__init__
    (core.build_parts, from the keywords options.EngineKeywords types)."""

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, template_kwargs)

    def encode_images(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], VisionInput]:
        """Rank 0: the prompt of a request with images (each image's marker expanded to its placeholder run) and
        the vision tower's embeddings for it (vision.py). PromptRejected for a model without vision, a Tensor
        split (every rank embeds there; only rank 0 has the tower) or an image that cannot be read."""
        vision = read_images(self.vision_tower(), messages)
        return self.tokenizer.encode_chat(messages, tools, template_kwargs), vision  # each marker expanded

    def vision_tower(self) -> Tower:
        """The checkpoint's vision tower, loaded at the first image (PromptRejected where images are not read)."""
        if self.kind == "tensor" and self.world_size > 1:
            raise PromptRejected("images are not served on a Tensor split: place the model as Pipeline or alone")
        if self._tower is None:
            tower = load_tower(self._model_dir, self._tower_dtype, self.device)
            if tower is None:
                raise PromptRejected("this model takes text only: images cannot be read")
            self._tower = tower
        return self._tower

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = "",
        vision: VisionInput | None = None,
    ) -> None:
        """Rank 0 queues the request for the next header; on other ranks this is a no-op. vision: its images'
        embeddings (encode_images), one per placeholder token of the prompt."""
        if not self.is_scheduler:
            return
        check_prompt(prompt_ids, self.context_length)
        if vision is not None:
            spans = image_spans(prompt_ids, self.model.args.image_token_id)
            if sum(e - s for s, e in spans) != vision.embeds.shape[0]:
                raise PromptRejected("the prompt's image placeholders do not match its images")
            self._visions[request_id] = vision  # its grids travel in the header (mrope.py); _new_request checks them
        known = {r.request_id for r in (*self._pending, *self._running)} | {a.request_id for a in self._adds}
        if request_id in known:
            raise ValueError(f"request {request_id!r} is already running")
        add = NewRequest.of(request_id, command_id, list(prompt_ids), sampling, vision.grids if vision else ())
        try:
            req = self._new_request(add)  # what every rank will build from the header: if it raises, it does here
            if self.fault_hook is not None:
                self.fault_hook("admit", req)
        except BaseException:
            self._visions.pop(request_id, None)
            raise
        self._adds.append(add)

    def cancel(self, request_id: str) -> None:
        """Rank 0 releases the request in the next header (every rank then frees it); elsewhere a no-op."""
        if not self.is_scheduler:
            return
        before = len(self._adds)
        self._adds = [a for a in self._adds if a.request_id != request_id]
        if len(self._adds) < before:
            self._visions.pop(request_id, None)
        else:
            self._releases.append(Release(request_id, cancelled=True))

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or (in a group) a heartbeat is due. Others: always, until
        shutdown, because they must be inside step() whenever rank 0 sends."""
        if not self.is_scheduler:
            return not self.closed
        if self._pending or self._running or self._adds or self._releases:
            return True
        return self.world_size > 1 and time.monotonic() - self._last_header >= GROUP_STEP_HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        if self._agree:
            self._agree_pool()
        with torch.inference_mode():
            header = self._lead() if self.is_scheduler else self._follow()
            started, waited = time.perf_counter(), self.link.wait_s
            if header.kind == StepKind.PREFILL:
                outs = self._prefill(header)
            elif header.kind == StepKind.MIXED:
                outs = self._mixed(header)
            elif header.kind == StepKind.DECODE:
                drafts = self._drafts() if self.speculate and self.fault_hook is None else None
                outs = self._speculate(drafts) if drafts else self._decode()
            else:
                if header.kind == StepKind.SHUTDOWN:
                    self.closed = True
                self._enter_phase("idle", "heartbeat")
                return []
            if self.is_scheduler:
                seconds = time.perf_counter() - started
                self._measure(header, seconds, self._chunk_done)
                self.flights.pace_part(header.kind, seconds - (self.link.wait_s - waited), self._step_rows)
            return outs

    def _agree_pool(self) -> None:
        """Every rank's allocator must make the same choices, so a group takes its smallest pool. Done at the
        first step, which every rank enters together (a collective while the ranks still load could outlast the
        group timeout), before any block is used; the cache's pages were never touched, so remaking it is free."""
        self._agree = False
        control = self.link.control_group if isinstance(self.link, GroupLink) else None
        local = self.local_blocks.num_blocks if self.local_blocks is not None else 0
        agreed = torch.tensor([self.blocks.num_blocks, local], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
        blocks, local_blocks = (int(n) for n in agreed.tolist())
        if (blocks, local_blocks) != (self.blocks.num_blocks, local):  # a hybrid model's groups agree each
            self.blocks = BlockAllocator(blocks, self.block_size)
            self.local_blocks = BlockAllocator(local_blocks, self.block_size) if local_blocks else None
            self.executor.resize(blocks, local_blocks or None)

    def warmup(self) -> None:
        """Rank 0 generates two tokens of a throwaway request and every rank steps until the header releases
        it, so each rank has run its layers and a group's connections are exercised."""
        self._warming = True
        if self.is_scheduler:
            prompt = self.tokenizer.encode("warmup") or [0]
            self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()

    # --- extras for the runner -----------------------------------------------------------------------------

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting on peers (pipeline recv, token share) since the runner last took it."""
        return self.link.wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self.link.wait_s = value

    @property
    def queued(self) -> int:
        """Requests waiting for rows or blocks (rank 0's view: the queue diagnostics show)."""
        return len(self._pending) + len(self._adds)

    def kv_usage(self) -> dict[str, int]:
        """The block pool at a glance: blocks in all, held by requests, cached prefixes, their size and bits, and
        the speculative draft tokens proposed and accepted so far (GET /metrics reads the latest record)."""
        usage = {"kv_blocks": self.blocks.num_blocks, "kv_blocks_held": self.blocks.held,
                 "kv_blocks_cached": self.blocks.cached, "kv_block_size": self.block_size, "kv_bits": self.kv_bits,
                 "running": len(self._running), "queued": self.queued, "preemptions": self.preemptions,
                 "spec_drafted": self.spec_drafted, "spec_accepted": self.spec_accepted}
        if self.local_blocks is not None:  # a hybrid model's sliding layers' pool (kv_pools.py)
            usage |= {"kv_local_blocks": self.local_blocks.num_blocks, "kv_local_blocks_held": self.local_blocks.held,
                      "kv_local_blocks_cached": self.local_blocks.cached, "kv_local_window": self.local_window}
        return usage

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
                if self._agree:  # the others wait for the agreement before any header
                    self._agree_pool()
                self.flights.drain()  # the sampler's sends of the steps in flight complete into rank 0's receives
                self.link.send_header(Header(StepKind.SHUTDOWN, (), tuple(self._releases)))
                self.link.flush()
            except RuntimeError:
                pass
        self.closed = True
