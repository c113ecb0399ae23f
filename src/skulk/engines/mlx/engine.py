"""MlxEngine: mlx-lm's model implementations behind the engine contract, with continuous batching and chunked
prefill.

The model is whatever `mlx_lm.utils.load_model` builds from the directory (every architecture mlx-lm knows,
float Hugging Face checkpoints and mlx-community quantized ones as they ship); nothing here re-implements a
layer. What this module adds around it is what the runner needs from any engine: requests that join and leave
between steps, prompts prefilled in chunks, cancellation, and the sampler's bookkeeping (sampling, logprobs,
stop strings, finish reasons, per-request failure), which is the torch engine's own (engines/torch/requests.py)
so both engines answer a request the same way.

One step is: a decode of every running request (one batched forward over mlx-lm's BatchKVCache, rows
left-padded to a common length), then either the queued prompts that each fit in one chunk, prefilled together
in one forward (as mlx-lm's batch generation prefills: right-padded, then rolled to left padding) and joined to
the batch, or the next chunk of the one prompt being prefilled in its own KVCache;
when that prompt completes its first token is sampled and its cache joins the batch (the cache's `merge` and
`extend`, as mlx-lm's BatchGenerator does). A request that finishes or is cancelled leaves the batch through
the cache's `filter`.

Distributed (Pipeline over mx.distributed's ring backend) lives in ring.py: the same engine with a `Stage`
that receives and sends hidden states around its slice of the layers.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from skulk.engines.base import GROUP_STEP_HEARTBEAT_S, TokenOut
from skulk.engines.errors import PromptRejected, check_prompt
from skulk.engines.torch.requests import FaultHook, Request, accept_each, reasoning_budget, row_sampling
from skulk.engines.torch.scheduler import Queue
from skulk.engines.torch.tokenizer import ChatTokenizer, IncrementalDecoder, StopMatcher
from skulk.engines.torch.vision import Tower, VisionInput, image_spans, load_tower, read_images, whole_images
from skulk.engines.torch.wire import Admitted, Released, RequestEvent, Started
from skulk.models.gguf_export import float_checkpoint
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.runners import RunnerPhase

from . import is_metal
from .ring import Header, NewRequest, RingLink, inner_model, shard_tensor, slice_pipeline
from .vision import image_embeddings, image_masks, image_token, to_mlx

DEFAULT_MAX_SEQ = 4096
DEFAULT_PREFILL_CHUNK = 512
_PHASES: dict[tuple[str, bool], tuple[RunnerPhase, RunnerPhase]] = {
    ("pipeline", False): ("prefill_stream", "decode_stream"),
    ("pipeline", True): ("prefill_pipeline", "decode_stream"),
    ("tensor", True): ("prefill_barrier", "decode_barrier"),
}
"""(prefill, decode) phases by (kind, over a ring), as the torch engine names them."""
WARMUP_ID = "__skulk_warmup__"
QUANT_BITS = {"int4": 4, "int8": 8}
QUANT_GROUP = 64  # mlx_lm.convert's default group size
PhaseHook = Callable[[RunnerPhase, str], None]
Cache = list[Any]
"""One mlx-lm cache object per layer (KVCache while prefilling, BatchKVCache once running)."""


def load(
    model_dir: Path, quantize: str | None = None, shape: Callable[[nn.Module], None] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """mlx-lm's model for the directory with its weights evaluated; a float checkpoint can be quantized while
    loading (`quantize_at_load`), as mlx_lm.convert would, with MLX's affine groups of 64. `shape` (a pipeline
    rank's slice) runs before evaluation, so weights it drops are never read. A GGUF import (which mlx-lm cannot
    read) loads from its bf16 export, written beside it on first use (models/gguf_export.py)."""
    path = float_checkpoint(model_dir)
    model, config = load_model(path, lazy=True, model_config=published_fields(path))
    if shape is not None:
        shape(model)
    if quantize is not None and "quantization" not in config:
        nn.quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS[quantize])
    mx.eval(model.parameters())
    return model, config


ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")


def published_fields(model_dir: Path) -> dict[str, Any]:
    """Config fields as the published checkpoints spell them, for a checkpoint saved by transformers 5, which
    renames some (mlx-lm's model arguments read the published names): rope settings kept inside
    `rope_parameters` (rope_theta, partial_rotary_factor, and rope_scaling for a non-default rope type),
    `num_local_experts` for Qwen's `num_experts`, and MiniMax-M2's `rotary_dim` and `shared_intermediate_size`;
    and a multimodal config's `vocab_size` beside its text_config (mlx-lm's Gemma 3 reads it there, else assumes
    the published 262208). Only fields the file lacks are given; an unreadable file gives none (mlx-lm's loader
    then says why)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    rope = inner.get("rope_parameters") if isinstance(inner.get("rope_parameters"), dict) else {}
    found: dict[str, Any] = {k: rope[k] for k in ROPE_FIELDS if k in rope}
    if rope:
        found["rope_scaling"] = None if rope.get("rope_type") in (None, "default") else rope
    if "num_local_experts" in inner:
        found["num_experts"] = inner["num_local_experts"]
    if inner.get("model_type") == "minimax_m2" and inner.get("head_dim"):
        found["rotary_dim"] = int(inner["head_dim"] * rope.get("partial_rotary_factor", 1.0))
        found["shared_intermediate_size"] = 0
    outer = {"vocab_size": inner["vocab_size"]} if inner is not config and "vocab_size" in inner else {}
    return {**{k: v for k, v in found.items() if k not in inner}, **{k: v for k, v in outer.items() if k not in config}}


def set_wired_limit(model: nn.Module) -> None:
    """On Metal, wire the weights in GPU memory as mlx-lm's generate does for large models (a model near the
    working set would otherwise be paged out between steps); a no-op on MLX's CPU backend."""
    if not is_metal() or not mx.metal.is_available():
        return
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    mx.set_wired_limit(limit)
    del model


def to_torch(logits: mx.array) -> torch.Tensor:
    """Logits [B, V] as float32 torch rows for the shared sampler (one row per request: the vocabulary)."""
    return torch.from_numpy(np.array(logits.astype(mx.float32), copy=False))


class MlxEngine:
    """One rank of an MLX instance: the whole model alone, or a Pipeline slice over a RingLink (ring.py)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_batch: int = 8,
        max_seq: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        quantize: str | None = None,
        link: RingLink | None = None,
        layers: tuple[int, int] | None = None,
        tensor: bool = False,
    ) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be at least 1")
        self.link = link
        self.rank, self.world_size = (link.rank, link.world_size) if link is not None else (0, 1)
        shape = None
        if link is not None and tensor:
            shape = functools.partial(shard_tensor, link=link)
        elif link is not None and layers is not None:
            shape = functools.partial(_slice, link=link, layers=layers)
        self.kind = "tensor" if tensor and link is not None else "pipeline"
        self.model, config = load(model_dir, quantize, shape)
        set_wired_limit(self.model)
        text = config.get("text_config", config)
        positions = int(text.get("max_position_embeddings") or DEFAULT_MAX_SEQ)
        self.context_length = min(positions, max_seq if max_seq is not None else DEFAULT_MAX_SEQ)
        self.vocab_size = int(text.get("vocab_size") or 0)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.tokenizer = ChatTokenizer(model_dir)
        self._model_dir, self.image_token = model_dir, image_token(config)
        self._tower: Tower | None = None
        self._visions: dict[str, VisionInput] = {}  # rank 0: a request's image embeddings, until it starts
        self.is_scheduler, self.is_sampler = self.rank == 0, self.rank == self.world_size - 1
        self.on_phase: PhaseHook | None = None
        self.fault_hook: FaultHook | None = None
        self.closed = False
        self._adds: list[NewRequest] = []  # rank 0: for the next header
        self._cancels: list[str] = []  # rank 0: for the next header
        # the torch scheduler's queue half (its block half stays there: mlx-lm's caches hold the KV here)
        self._queue: Queue[Request] = Queue()
        self._pending, self._running = self._queue.pending, self._queue.running  # running: row i of the batch cache
        self._prefilling: tuple[Request, Cache] | None = None
        self._batch: Cache | None = None
        self._batched = False  # _batch is mlx-lm's BatchKVCache (else one request's own KVCache)
        self._releases: list[tuple[str, bool, bool]] = []  # (request_id, cancelled, failed), at the next step
        self._events: list[RequestEvent] = []
        self._warming = False
        self._last_header = 0.0
        self._phase: RunnerPhase = "idle"
        self._unseeded = torch.Generator().manual_seed(secrets.randbits(63))

    # --- the Engine protocol -------------------------------------------------------------------------------

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, template_kwargs)

    def encode_images(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], VisionInput]:
        """Rank 0: the prompt of a request with images (each image's marker expanded to its placeholder run) and
        the vision tower's embeddings for it (vision.py), as the torch engine gives them. PromptRejected for a
        model without vision (or one whose images this engine cannot read), a Tensor split (every rank embeds
        there; only rank 0 has the tower) or an image that cannot be read."""
        vision = read_images(self.vision_tower(), messages)
        return self.tokenizer.encode_chat(messages, tools, template_kwargs), vision  # each marker expanded

    def vision_tower(self) -> Tower:
        """The checkpoint's vision tower (torch, float32, on the CPU), loaded at the first image."""
        if self.kind == "tensor" and self.world_size > 1:
            raise PromptRejected("images are not served on a Tensor split: place the model as Pipeline or alone")
        if self.image_token is None:
            raise PromptRejected("this model takes text only on the MLX engine: images cannot be read")
        if self._tower is None:
            self._tower = load_tower(self._model_dir, torch.float32, torch.device("cpu"))
            if self._tower is None:
                raise PromptRejected("this model takes text only: images cannot be read")
        return self._tower

    def add_request(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, command_id: str = "",
        vision: VisionInput | None = None,
    ) -> None:
        """Rank 0 queues the request for the next step (every rank builds it from the header); elsewhere a no-op.
        vision: its images' embeddings (encode_images), one per placeholder token of the prompt."""
        if not self.is_scheduler:
            return
        check_prompt(prompt_ids, self.context_length)
        if vision is not None and sum(e - s for s, e in image_spans(prompt_ids, self.image_token)) != len(
                vision.embeds):
            raise PromptRejected("the prompt's image placeholders do not match its images")
        known = self._queue.ids() | {a.request_id for a in self._adds}
        if self._prefilling is not None:
            known.add(self._prefilling[0].request_id)
        if request_id in known:
            raise ValueError(f"request {request_id!r} is already running")
        if sampling.constraint is not None:  # never an unconstrained reply to a request that asked for one
            raise PromptRejected("JSON output and forced tool calls are constrained on the torch engine only; "
                                 "place this model with the torch engine for them")
        add = NewRequest(request_id=request_id, command_id=command_id, prompt=list(prompt_ids), sampling=sampling)
        req = self._new_request(add)  # what every rank will build from the header: if it raises, it does here
        if self.fault_hook is not None:
            self.fault_hook("admit", req)
        if vision is not None:
            self._visions[request_id] = vision
        self._adds.append(add)

    def cancel(self, request_id: str) -> None:
        """Released at the start of the next step (on every rank); it yields no more tokens."""
        if self.is_scheduler:
            self._cancels.append(request_id)

    def has_work(self) -> bool:
        """Rank 0: something to compute or announce, or (over a ring) a heartbeat is due. Others: always, until
        shutdown, since they must be inside step() whenever rank 0 steps."""
        if not self.is_scheduler:
            return not self.closed
        if self._adds or self._cancels or self._pending or self._prefilling or self._running or self._releases:
            return True
        return self.link is not None and time.monotonic() - self._last_header >= GROUP_STEP_HEARTBEAT_S

    def step(self) -> list[TokenOut]:
        header = self._exchange_header()
        if header.shutdown:
            self.closed = True
            return []
        self._apply_releases()
        outs = self._decode() if self._running else []
        group = self._short_prompts() if self._prefilling is None else []
        if len(group) > 1:
            outs += self._prefill_together(group)
        elif self._prefilling is None and self._pending and len(self._running) < self.max_batch:
            self._start_prefill(self._pending.popleft())
        if self._prefilling is not None:
            outs += self._prefill_chunk()
        if not self._running and self._prefilling is None:
            self._enter_phase("idle", "no_work")
        return outs

    def warmup(self) -> None:
        """Generate two tokens of a throwaway request (on every rank of a ring: each runs its layers and the ring
        its sends), so the first real one pays for no lazy initialisation."""
        self._warming = True
        prompt = self.tokenizer.encode("warmup") or [0]
        self.add_request(WARMUP_ID, prompt[: self.context_length], SamplingParams(max_tokens=2, temperature=0))
        while self._warming:
            self.step()
        self._events.clear()

    # --- extras for the runner -----------------------------------------------------------------------------

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting on peers (headers, token shares) since the runner last took it."""
        return self.link.wait_s if self.link is not None else 0.0

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        if self.link is not None:
            self.link.wait_s = value

    def take_events(self) -> list[RequestEvent]:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Rank 0 tells every rank to leave; a dead peer no longer matters here."""
        if self.is_scheduler and self.link is not None and not self.closed:
            self.closed = True
            try:
                self.link.exchange_header(Header(shutdown=True))
            except RuntimeError:
                pass
        self.closed = True

    # --- scheduling ----------------------------------------------------------------------------------------

    def _exchange_header(self) -> Header:
        """Rank 0's adds and cancels, applied on every rank in the same order (alone: applied in place)."""
        mine = Header(adds=self._adds, cancels=self._cancels) if self.is_scheduler else None
        self._adds, self._cancels = [], []
        header = self.link.exchange_header(mine) if self.link is not None else (mine or Header())
        self._last_header = time.monotonic()
        for request_id in header.cancels:
            self._releases.append((request_id, True, False))
        for add in header.adds:
            self._pending.append(self._new_request(add))
            self._visions.pop(add.request_id, None)  # the request holds its embeddings now
            if add.request_id != WARMUP_ID:
                self._events.append(Admitted(add.request_id, add.command_id, len(add.prompt), 0.0,
                                             tuple(add.prompt[-8:]), add.sampling.constraint is not None))
        return header

    def _new_request(self, add: NewRequest) -> Request:
        s = add.sampling
        row = row_sampling(s, self.vocab_size or 1 << 30, torch.device("cpu"), self._unseeded)
        return Request(add.request_id, list(add.prompt), s.max_tokens, row, IncrementalDecoder(self.tokenizer.decode),
                       StopMatcher(s.stop), command_id=add.command_id,
                       budget=reasoning_budget(s, add.prompt, self.tokenizer) if self.is_sampler else None,
                       spans=image_spans(add.prompt, self.image_token), vision=self._visions.get(add.request_id))

    def _apply_releases(self) -> None:
        releases, self._releases = self._releases, []
        for request_id, cancelled, failed in releases:
            self._release(request_id, cancelled, failed)

    def _release(self, request_id: str, cancelled: bool, failed: bool = False) -> None:
        """Drop the request wherever it is: the queue, its row of the batch, or the prefill."""
        found, row = self._queue.take(request_id)
        if row is not None:
            self._filter_batch([i for i in range(len(self._running) + 1) if i != row])
        elif found is None and self._prefilling is not None and self._prefilling[0].request_id == request_id:
            found, self._prefilling = self._prefilling[0], None
        if found is None:
            return
        if found.request_id == WARMUP_ID:
            self._warming = False
        else:
            self._events.append(Released(found.request_id, found.command_id, cancelled, failed))

    def _filter_batch(self, keep: list[int]) -> None:
        if self._batch is None:
            return
        if not keep or not self._batched:  # a lone request's own cache holds no other row
            self._batch = None if not keep else self._batch
            return
        index = mx.array(keep)
        for cache in self._batch:
            cache.filter(index)

    def _start_prefill(self, req: Request) -> None:
        self._prefilling = (req, make_prompt_cache(self.model))
        req.length = 0
        if req.request_id != WARMUP_ID:
            self._events.append(Started(req.request_id, req.command_id, 0))

    def _enter_phase(self, phase: RunnerPhase, event: str) -> None:
        if phase != self._phase:
            self._phase = phase
            if self.on_phase is not None:
                self.on_phase(phase, event)

    # --- compute -------------------------------------------------------------------------------------------

    def _prefill_chunk(self) -> list[TokenOut]:
        """The next chunk of the prompt being prefilled; its first token once the prompt is complete."""
        assert self._prefilling is not None
        req, cache = self._prefilling
        self._enter_phase(_PHASES[self.kind, self.link is not None][0], "prefill")
        start = req.length
        end = start + whole_images(req.spans, start, min(len(req.prompt) - start, self.prefill_chunk))
        logits = self._chunk_forward(req, cache, start, end)
        req.length = end
        if end < len(req.prompt):  # the output too: a tensor rank's last all_sum is not under the cache
            mx.eval([c.state for c in cache], *([] if logits is None else [logits]))
            return []
        self._prefilling = None
        self._join_batch(req, cache)
        return self._accept(logits, [req])  # done with its first token: it leaves the batch it just joined

    def _chunk_forward(self, req: Request, cache: Cache, start: int, end: int) -> mx.array | None:
        """The forward pass over prompt[start:end]; where the chunk holds image placeholders, with the tower's
        embeddings in their rows (rank 0) and each image's tokens attending to each other (every rank: vision.py)."""
        ids = mx.array([req.prompt[start:end]])
        if not any(s < end and e > start for s, e in req.spans):
            return self._forward(ids, cache)
        embeds = None
        if self.rank == 0 and req.vision is not None:
            embeds = image_embeddings(inner_model(self.model), ids, req.spans, start, to_mlx(req.vision.embeds))
        with image_masks(cache, req.spans, start):
            return self._forward(ids, cache, embeds=embeds)

    def _short_prompts(self) -> list[Request]:
        """The queued prompts, from the front, that each fit in one prefill chunk, as many as the batch has room
        for: prefilled together in one forward pass, as mlx-lm's batch generation prefills its prompts."""
        room = self.max_batch - len(self._running)
        group: list[Request] = []
        for req in self._pending:
            if len(group) == room or len(req.prompt) > self.prefill_chunk or req.spans:  # an image's: alone
                break
            group.append(req)
        return group

    def _prefill_together(self, group: list[Request]) -> list[TokenOut]:
        """Several whole prompts in one forward over one BatchKVCache, right-padded then rolled to mlx-lm's left
        padding (its cache's prepare/finalize), their first tokens sampled, and the batch joined."""
        self._enter_phase(_PHASES[self.kind, self.link is not None][0], "prefill")
        for req in group:
            self._pending.popleft()
            req.length = len(req.prompt)
            if req.request_id != WARMUP_ID:
                self._events.append(Started(req.request_id, req.command_id, 0))
        lengths = [len(r.prompt) for r in group]
        width = max(lengths)
        cache = [layer[0].merge(list(layer)) for layer in zip(*(make_prompt_cache(self.model) for _ in group),
                                                                strict=True)]
        for layer in cache:
            layer.prepare(lengths=lengths, right_padding=[width - n for n in lengths])
        ids = mx.array([r.prompt + [0] * (width - len(r.prompt)) for r in group])
        logits = self._forward(ids, cache, last=False)
        for layer in cache:
            layer.finalize()
        mx.eval([c.state for c in cache])
        if logits is not None:
            logits = logits[mx.arange(len(group)), mx.array(lengths) - 1]
        for req in group:
            self._running.append(req)
        self._extend_batch(cache)
        return self._accept(logits, group)

    def _extend_batch(self, cache: Cache) -> None:
        if self._batch is None:
            self._batch, self._batched = cache, True
            return
        if not self._batched:
            self._batch, self._batched = [c.merge([c]) for c in self._batch], True
        for mine, theirs in zip(self._batch, cache, strict=True):
            mine.extend(theirs)

    def _join_batch(self, req: Request, cache: Cache) -> None:
        """A lone request decodes on its own KVCache (no padding mask: mlx-lm's single-stream path); a second
        one turns the batch into a BatchKVCache and joins it."""
        if self._batch is None:
            self._batch, self._batched = cache, False
        else:
            self._extend_batch([c.merge([c]) for c in cache])
        self._running.append(req)

    def _decode(self) -> list[TokenOut]:
        """One token for every running request, in one batched forward pass."""
        self._enter_phase(_PHASES[self.kind, self.link is not None][1], "decode")
        running = list(self._running)
        ids = mx.array([[max(r.last_token, 0)] for r in running])
        logits = self._forward(ids, self._batch)
        for req in running:
            req.length += 1
        return self._accept(logits, running)

    def _forward(self, ids: mx.array, cache: Cache | None, last: bool = True,
                 embeds: mx.array | None = None) -> mx.array | None:
        """This rank's part of the forward pass: the last position's logits on the sampler, None elsewhere (a
        pipeline rank before the last evaluates its slice, which sends the hidden state on; a tensor rank its
        shard of every layer, whose all_sums meet the others', and skips the head). embeds: the input embeddings
        in place of the ids' (an image chunk on rank 0)."""
        extra = {} if embeds is None else {"input_embeddings": embeds}
        if self.is_sampler:
            logits = self.model(ids, cache=cache, **extra)
            return logits[:, -1, :] if last else logits
        mx.eval(inner_model(self.model)(ids, cache=cache, **extra))
        return None

    def _accept(self, logits: mx.array | None, reqs: list[Request]) -> list[TokenOut]:
        """The sampler's bookkeeping over these rows (engines/torch/requests.py: the torch engine's own), then
        [token, finished, failed] per row on every rank. Finished rows leave the batch at the start of the next
        step, as the torch engine's do: the runner publishes a request's last token before hearing it released."""
        outs: list[TokenOut] = []
        rows: list[list[int]] | None = None
        if logits is not None:
            outs = accept_each(to_torch(logits), reqs, self.tokenizer.eos_ids, self.context_length, self.fault_hook)
            rows = [[0, 1, 1] if o.error else [o.token_id, int(o.finish_reason is not None), 0] for o in outs]
        if self.link is not None:
            rows = self.link.share_tokens(rows, len(reqs))
        for req, (token, finished, failed) in zip(reqs, rows or [], strict=True):
            req.last_token = token
            if finished:
                req.finished = True
                self._releases.append((req.request_id, False, bool(failed)))
        return outs


def _slice(model: nn.Module, *, link: RingLink, layers: tuple[int, int]) -> None:
    slice_pipeline(model, link, *layers)
