"""The runner itself: load the shard, warm up under a deadline, then serve tasks with continuous batching.

The process entry (`runner.main`) picks this class or its subclass `runner.embedder.EmbeddingRunner`; both import
this module and this module imports neither, so the runner package has no import circle."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psutil

from skulk.engines.base import Engine, Footprinted, Sees, TokenOut
from skulk.engines.errors import PromptRejected
from skulk.engines.reasoning import ReasoningMode
from skulk.runner.admission import admit
from skulk.runner.channel import Inbox, Outbox, Source
from skulk.runner.fault import Fault, FaultInjector, engine_hook, fault_from_setting
from skulk.runner.messages import (
    CancelTask,
    Footprint,
    FromRunner,
    Records,
    RunTask,
    Shutdown,
    Spans,
    StatusChanged,
    TaskAccepted,
    TaskEnded,
    Tokens,
    ToRunner,
)
from skulk.runner.recorder import FlightRecorder
from skulk.runner.spans import SpanBook
from skulk.runner.spec import RunnerSpec
from skulk.runner.stats import RequestClock
from skulk.types.chunks import ErrorChunk, TokenChunk
from skulk.types.errors import ErrorCode, clip_text
from skulk.types.ids import CommandId, TaskId
from skulk.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerLoaded,
    RunnerLoading,
    RunnerPhase,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
)
from skulk.types.tasks import ChatCompletion, TaskStatus, TextEmbedding

if TYPE_CHECKING:
    from skulk.engines.mlx.engine import MlxEngine
    from skulk.engines.torch.engine import TorchEngine
    from skulk.engines.torch.fallback import FallbackEngine
    from skulk.engines.torch.wire import RequestEvent
    from skulk.runner.group import Group

log = logging.getLogger("skulk.runner")

IDLE_POLL_S = 0.25


class _Active:
    __slots__ = ("clock", "command_id", "completion_tokens", "prompt_tokens", "reasoning")
    reasoning: ReasoningMode | None

    def __init__(self, command_id: CommandId, prompt_tokens: int, in_flight: int = 0,
                 admitted_at: float | None = None, reasoning: ReasoningMode | None = None) -> None:
        self.command_id = command_id
        self.reasoning = reasoning
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.clock = RequestClock(in_flight, admitted_at)


class Runner:
    def __init__(self, spec: RunnerSpec, inbox: Source, outbox: Outbox) -> None:
        self.spec = spec
        self.inbox = Inbox(inbox)
        self.outbox = outbox
        self.recorder = FlightRecorder(spec.context(os.getpid()), enabled=spec.record)
        self.engine: TorchEngine | MlxEngine | FallbackEngine | None = None
        self.active: dict[TaskId, _Active] = {}
        self.status: RunnerStatus | None = None
        self.stopping = False
        self._after_step: list[FromRunner] = []
        self.spans = SpanBook(spec.shard.device_rank)
        self._new_tasks: list[str] = []  # admitted since the last step: its prefill runs in the next one
        # world_size > 1: rank 0 schedules through step headers; other ranks follow them, not their inbox
        self.group: Group | None = None
        self.schedules = spec.shard.device_rank == 0
        self.fault_spec = fault_from_setting(spec.fault)
        fault = self.fault_spec
        self.fault = FaultInjector(fault, spec.shard.device_rank, self.flush) if isinstance(fault, Fault) else None
        if self.fault is not None:
            self.recorder.on_enter = self.fault.on_enter

    def send(self, message: FromRunner) -> None:
        if isinstance(message, TaskEnded):
            self.spans.end(message.task_id)
        self.outbox.put(message)

    def set_status(self, status: RunnerStatus, *, after_step: bool = False) -> None:
        if type(status) is not type(self.status):
            self.status = status
            if after_step:
                self._after_step.append(StatusChanged(status))
            else:
                self.send(StatusChanged(status))

    def send_after_step(self) -> None:
        """Bookkeeping that the cluster reacts to (acceptance, Running) waits until the prefill is done:
        the node's reaction would otherwise compete with the prefill for the same cores."""
        for message in self._after_step:
            self.send(message)
        self._after_step.clear()

    def flush(self) -> None:
        entries = self.recorder.drain()
        if entries:
            self.send(Records(entries))
        if self.spans.has_spans:
            self.send(Spans(self.spans.drain()))

    def start(self) -> None:
        self.recorder.record("created", "process_started")
        if self.spec.shard.world_size > 1 and (self.spec.engine == "torch" or self.spec.mixed):
            self._connect()  # an MLX rank forms its ring while it builds its engine (engines/mlx/build.py)
        self.set_status(RunnerLoading())
        self.recorder.record("load_model", "load_started", str(self.spec.model_dir))
        self.flush()
        self.engine = self._build_engine()
        self._follow_card(self.engine)
        self._install_poison_hook(self.engine)
        self.recorder.record("load_model", "load_finished", with_memory=True)
        self.set_status(RunnerLoaded())
        self.set_status(RunnerWarmingUp())
        self.recorder.record("warmup", "warmup_started")
        self.flush()
        self._warmup_with_deadline(self.engine)
        self.recorder.record("warmup", "warmup_finished", with_memory=True)
        # The model's hundreds of thousands of tracked objects never die: out of the collector's sight, a prefill
        # no longer spends part of its time walking them (SmolLM2 int4, 2,048 tokens: 3-4 % faster per CPU second).
        gc.freeze()
        if self.fault is not None:
            self.fault.arm()
        self._report_footprint(self.engine)
        self.recorder.record("idle", "ready")
        self.set_status(RunnerReady())
        self.flush()

    def _report_footprint(self, engine: Engine) -> None:
        """Once warm, a torch rank tells its node what it holds besides weights and KV (messages.Footprint): the
        runtime overhead placement counts for this node's next ranks."""
        if self.spec.engine == "torch" and isinstance(engine, Footprinted):
            weights, kv = engine.footprint()
            self.send(Footprint(resident=psutil.Process().memory_info().rss, weights=weights, kv=kv))

    def _follow_card(self, engine: Engine) -> None:
        """The card's format overrides reach the tokenizer, where the engine decides a reasoning budget's mode
        and a forced call's format by them (the API node reads the reply by the same overrides)."""
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "card_reasoning"):
            card = self.spec.shard.model_card
            tokenizer.card_reasoning, tokenizer.card_tool_parser = card.reasoning_parser, card.tool_parser

    def _install_poison_hook(self, engine: Engine) -> None:
        """SKULK_FAULT=raise:/crash:/script: acts inside the engine, on requests carrying its marker."""
        fault = self.fault_spec
        if fault is None or isinstance(fault, Fault):
            return
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is not None and hasattr(engine, "fault_hook"):
            engine.fault_hook = engine_hook(fault, self.spec.shard.device_rank, tokenizer)  # type: ignore[attr-defined]

    def _connect(self) -> None:
        from skulk.runner.group import connect_group

        self.set_status(RunnerConnecting())
        self.flush()
        self.group = connect_group(self.spec, self.recorder)
        self.set_status(RunnerConnected())

    def _build_engine(self) -> TorchEngine | MlxEngine | FallbackEngine:
        from skulk.engines.torch.engine import TorchEngine
        from skulk.models.demo import ensure_builtin_model, is_builtin

        shard = self.spec.shard
        if is_builtin(shard.model_card.model_id):
            ensure_builtin_model(shard.model_card.model_id, self.spec.model_dir.parent)
        if self.spec.engine == "mlx" and not self.spec.mixed:
            from skulk.engines.mlx.build import build_mlx_engine

            return build_mlx_engine(self.spec, self._engine_phase)
        if self.group is not None:
            return self._build_distributed_engine(self.group)
        if shard.model_card.torch_runtime == "transformers":
            from skulk.engines.torch.fallback import FallbackEngine

            return FallbackEngine(self.spec.model_dir, max_seq=self.spec.context_length,
                                  kv_cache_bytes=self.spec.kv_cache_bytes)
        draft = shard.model_card.draft_model
        if draft is not None:
            log.info("draft model %s %s", draft, f"drafts for {shard.model_card.model_id} (speculative decoding)"
                     if self.spec.draft_dir is not None else "is not on this node: prompt lookup drafts instead")
        from skulk.engines.torch.device import engine_device

        return TorchEngine(self.spec.model_dir, start_layer=shard.start_layer, end_layer=shard.end_layer,
                           device=engine_device(),
                           quantize=shard.model_card.quantize_at_load, prefill_chunk=self.spec.prefill_chunk_tokens,
                           max_seq=self.spec.context_length, kv_cache_bytes=self.spec.kv_cache_bytes,
                           kv_cache_bits=shard.model_card.kv_cache_bits, draft_dir=self.spec.draft_dir)

    def _build_distributed_engine(self, group: Group) -> TorchEngine | FallbackEngine:
        from skulk.runner.group import build_engine

        engine = build_engine(self.spec, group)
        engine.on_phase = self._engine_phase
        self.recorder.record("connect_group", "waiting_for_peers_to_load")
        self.flush()
        group.wait_all_loaded(self.spec.warmup_deadline_s)
        return engine

    def _warmup_with_deadline(self, engine: Engine) -> None:
        deadline = self.spec.warmup_deadline_s

        def overrun() -> None:
            log.critical(
                "warmup of runner %s exceeded %.0f s (SKULK_WARMUP_DEADLINE_SECONDS). The accelerator may be "
                "wedged: if this recurs on this node, reboot the machine.",
                self.spec.runner_id,
                deadline,
            )
            os._exit(3)

        watchdog = threading.Timer(deadline, overrun)
        watchdog.daemon = True
        watchdog.start()
        try:
            engine.warmup()
        finally:
            watchdog.cancel()

    def serve(self) -> None:
        assert self.engine is not None
        engine = self.engine
        while not self.stopping and not engine.closed:
            self._take_messages(block=not engine.has_work())
            if engine.has_work():
                started = time.time()
                outs = engine.step()
                # admissions first: a prefill's token belongs to a task admitted now
                self._follow_requests(engine.take_events())
                waited = self._take_wait()
                self.spans.step(started, time.time(), self._new_tasks, self.active, waited)
                self._new_tasks.clear()
                self._publish(outs)
            self.send_after_step()
            self.flush()
        if self.spec.shard.world_size > 1:  # a torch group or an MLX ring
            engine.close()
            self._follow_requests(engine.take_events())
            if self.group is not None:
                self.group.destroy()
        self.recorder.record("shutdown_cleanup", "shutdown")
        self.set_status(RunnerShutdown())
        self.flush()

    def _take_messages(self, *, block: bool) -> None:
        """Handle what the supervisor sent; while busy an empty inbox costs one in-memory check (channel.Inbox)."""
        for message in self.inbox.take(IDLE_POLL_S if block else None):
            self._handle(message)

    def _handle(self, message: ToRunner) -> None:
        match message:
            case RunTask(task=TextEmbedding() as task) if self.schedules:
                self._fail(task.task_id, task.command_id, f"{task.model} generates text and cannot embed; send "
                           "embeddings to an embedding model", code=ErrorCode.model_not_embedding)
            case RunTask(task=ChatCompletion() as task) if self.schedules:
                self._accept(task)
            case RunTask(task=task) if task.traced:  # a following rank: its spans of this task are kept
                self.spans.trace(task.task_id)
            case CancelTask(task_id=task_id) if self.schedules:
                self.recorder.record("cancel_requested", "cancel_received", task_id=task_id)
                self._cancel(task_id)
            case Shutdown():
                for task_id in list(self.active):
                    self._cancel(task_id)
                self.stopping = True

    def _accept(self, task: ChatCompletion) -> None:
        assert self.engine is not None
        ids: dict[str, Any] = dict(task_id=task.task_id, command_id=task.command_id)
        self.recorder.record("task_submission", "task_received", **ids)
        self._after_step.append(TaskAccepted(task.task_id))
        self.recorder.record("prompt_build", "chat_template", **ids)
        if task.traced:
            self.spans.trace(task.task_id)
        started = time.time()
        try:
            prompt = self._admit(task)
        except Exception as exc:  # this request alone fails; the runner and its batch go on
            self.send_after_step()
            self._fail_in_engine(task.task_id, task.command_id, exc)
            return
        if prompt is None:
            return
        constrained = task.task_params is not None and task.task_params.sampling.constraint is not None
        self.active[task.task_id] = _Active(task.command_id, len(prompt), len(self.active),
                                            reasoning=self._reasoning_mode(prompt, constrained))
        self.recorder.record("prefill_stream", "prefill_queued", prompt_tokens=len(prompt), **ids)
        self.spans.span(task.task_id, "tokenize", started, time.time(), prompt_tokens=len(prompt))
        self._new_tasks.append(task.task_id)
        self.set_status(RunnerRunning(), after_step=True)

    def _admit(self, task: ChatCompletion) -> list[int] | None:
        """Template, check the context and add to the engine; None when rejected (already reported)."""
        assert self.engine is not None
        params = task.task_params  # attached by the worker from the API node's payload; never in state
        assert params is not None, "a task reached the runner without its payload"
        vision = None
        try:
            if any(m.images for m in params.messages):
                prompt, vision = self._encode_images(task)
            else:
                prompt = self.engine.encode_chat(params.messages, params.tools or None, params.template_kwargs)
        except PromptRejected as refused:
            self.send_after_step()
            self._fail(task.task_id, task.command_id, str(refused), code=ErrorCode.invalid_request)
            return None
        message, sampling = admit(len(prompt), params.sampling, self.engine.context_length, params.context_limit)
        if message is not None:
            self.send_after_step()
            self._fail(task.task_id, task.command_id, message, code=ErrorCode.context_length_exceeded)
            return None
        try:
            if vision is not None and isinstance(self.engine, Sees):  # it gave the embeddings (_encode_images)
                self.engine.add_request(task.task_id, prompt, sampling, command_id=task.command_id, vision=vision)
            else:
                self.engine.add_request(task.task_id, prompt, sampling, command_id=task.command_id)
        except PromptRejected as refused:  # e.g. an output schema the grammar library cannot compile: a 400
            self.send_after_step()
            self._fail(task.task_id, task.command_id, str(refused), code=ErrorCode.invalid_request)
            return None
        return prompt

    def _encode_images(self, task: ChatCompletion) -> tuple[list[int], Any]:
        """A request with images: the engine's vision tower (rank 0's) embeds them, in the `vision_preprocess`
        phase with its start and end on the timeline; an engine without one refuses them as text-only."""
        params = task.task_params
        assert params is not None and self.engine is not None
        if not isinstance(self.engine, Sees):
            raise PromptRejected("this model takes text only on this engine: images cannot be read")
        engine = self.engine
        images = sum(len(m.images) for m in params.messages)
        before = self.recorder.phase
        self.recorder.record("vision_preprocess", "vision_start", images=images, task_id=task.task_id)
        started = time.time()
        try:
            prompt, vision = engine.encode_images(params.messages, params.tools or None, params.template_kwargs)
        finally:
            self.recorder.record(before, "vision_done", images=images, task_id=task.task_id)
        self.spans.span(task.task_id, "vision_preprocess", started, time.time(), images=images)
        return prompt, vision

    def _reasoning_mode(self, prompt: Sequence[int], constrained: bool) -> ReasoningMode | None:
        """How the API node splits this reply's reasoning: the card's reasoning_parser, else the template's. A
        constrained reply (JSON, a forced call) is held to its grammar from its first token, so it has no reasoning
        to split, unless its prompt opened the reasoning block: then the grammar waits for the close
        (engines/torch/requests.held_for_reasoning) and the reply reasons first; or it is harmony's, whose grammar
        lets one analysis message through before the call or the final channel's JSON (engines/constrained.py).
        Harmony's split passes a reply with no headers through as content."""
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None or not hasattr(tokenizer, "reasoning_mode"):
            return None
        mode: ReasoningMode | None = tokenizer.reasoning_mode(prompt, self.spec.shard.model_card.reasoning_parser)
        return mode if not constrained or mode in ("think_open", "harmony") else None

    def _fail_in_engine(self, task_id: TaskId, command_id: CommandId, why: BaseException | str) -> None:
        """A request that raised inside the engine ends with a 500; the others are untouched."""
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        log.info("task %s failed by a fault in the engine: %s", task_id, reason)
        message = f"the request failed inside the engine ({reason}); the other requests were not affected"
        self._fail(task_id, command_id, message, code=ErrorCode.internal_error)

    def _fail(self, task_id: TaskId, command_id: CommandId, message: str, *, code: ErrorCode) -> None:
        chunk = ErrorChunk(command_id=command_id, message=message, code=code, status=code.status, retryable=False)
        self.send(Tokens([chunk]))
        self.send(TaskEnded(task_id, command_id, TaskStatus.Failed, message, retryable=False))
        self.recorder.record("error", code, clip_text(message, 120), task_id=task_id, command_id=command_id)

    def _cancel(self, task_id: TaskId) -> None:
        active = self.active.pop(task_id, None)
        if active is None or self.engine is None:
            return
        self.engine.cancel(task_id)
        self.recorder.record("cancel_observed", "cancelled", task_id=task_id, command_id=active.command_id)
        self.send(TaskEnded(task_id, active.command_id, TaskStatus.Cancelled))
        self._maybe_idle()

    def _publish(self, outs: list[TokenOut]) -> None:
        chunks: list[TokenChunk | ErrorChunk] = []
        ended: list[TaskEnded] = []
        failed: list[tuple[TaskId, CommandId, str]] = []
        now = time.perf_counter()
        for out in outs:
            active = self.active.get(TaskId(out.request_id))
            if active is None:
                continue
            if out.error is not None:
                del self.active[TaskId(out.request_id)]
                failed.append((TaskId(out.request_id), active.command_id, out.error))
                continue
            active.completion_tokens += 1
            active.clock.on_token(now)
            if active.completion_tokens == 1:  # once per request: the prefill's token is out, decoding begins
                self.recorder.record("decode_stream", "first_token", task_id=out.request_id,
                                     command_id=active.command_id)
            chunks.append(
                TokenChunk(
                    command_id=active.command_id,
                    text=out.text,
                    token_id=out.token_id,
                    finish_reason=out.finish_reason,
                    stop_sequence=out.stop_sequence,
                    logprobs=out.logprobs,
                    reasoning=active.reasoning if active.completion_tokens == 1 else None,
                    prompt_tokens=active.prompt_tokens,
                    completion_tokens=active.completion_tokens,
                    stats=None if out.finish_reason is None else active.clock.stats(
                        active.prompt_tokens, active.completion_tokens
                    ),
                )
            )
            if out.finish_reason is not None:
                del self.active[TaskId(out.request_id)]
                ended.append(TaskEnded(TaskId(out.request_id), active.command_id, TaskStatus.Complete))
        if chunks:
            self.send(Tokens(chunks))
        self.send_after_step()  # tokens first: they are what the client waits for
        for task_id, command_id, error in failed:
            self._fail_in_engine(task_id, command_id, error)
        for end in ended:
            self.recorder.record(
                "completion",
                "task_complete",
                task_id=end.task_id,
                command_id=end.command_id,
                with_memory=True,
            )
            self.send(end)
        if ended or failed:
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self.active:
            self.recorder.record("idle", "no_active_tasks")
            self.set_status(RunnerReady())

    def _take_wait(self) -> float:
        """Seconds this step waited on peers (distributed engine), for the trace spans."""
        if self.engine is None:
            return 0.0
        waited, self.engine.wait_s = self.engine.wait_s, 0.0
        return waited

    def _engine_phase(self, phase: RunnerPhase, event: str) -> None:
        """Called by the distributed engine only when its phase changes, before it may block on a peer, so a
        waiting rank shows as waiting in diagnostics (never per token)."""
        self.recorder.record(phase, event)
        self.flush()

    def _follow_requests(self, events: list[RequestEvent]) -> None:
        """Report what the step headers admitted, started and released; idempotent, so rank 0, which already
        reported from its inbox, and the sampler, which reported completions when publishing, skip them."""
        if not events:  # most steps: not even the import below
            return
        from skulk.engines.torch.wire import Admitted, Started

        released = 0
        for event in events:
            task_id = TaskId(event.request_id)
            ids: dict[str, Any] = dict(task_id=task_id, command_id=event.command_id)
            if isinstance(event, Started):  # the slot is taken: its prefill starts from any reused prefix
                # reported after the step that took it: the rank is back in the phase it is really in
                current = self.recorder.phase
                hit = "prefix_hit" if event.reused_tokens else "prefix_miss"
                usage = getattr(self.engine, "kv_usage", dict)()  # the paged pool: blocks held, cached, queue
                self.recorder.record("kv_cache_lookup", hit, reused_tokens=event.reused_tokens, **usage, **ids)
                self.recorder.record(current, "prefill_started", **ids)
                continue
            if isinstance(event, Admitted):
                if task_id in self.active:
                    continue
                self.recorder.record("task_agreement", "task_admitted", prompt_tokens=event.prompt_tokens, **ids)
                self.send(TaskAccepted(task_id))
                # from when the header arrived, not now: the prefill already ran (prompt_tps read 10^6 tok/s)
                self.active[task_id] = _Active(CommandId(event.command_id), event.prompt_tokens,
                                               admitted_at=event.at or None,
                                               reasoning=self._reasoning_mode(event.prompt_tail, event.constrained))
                self._new_tasks.append(task_id)
                self.set_status(RunnerRunning())
                continue
            released += 1
            active = self.active.pop(task_id, None)
            if active is None:
                continue
            status = TaskStatus.Cancelled if event.cancelled else TaskStatus.Complete
            error = None
            if event.failed:  # the sampling rank reported the error to the client; this rank only lets go
                status, error = TaskStatus.Failed, "the request failed on the sampling rank"
            self.recorder.record("completion", status.value.lower(), **ids)
            self.send(TaskEnded(task_id, active.command_id, status, error, retryable=False))
            self._maybe_idle()
        if released:
            self._record_pool(released)

    def _record_pool(self, released: int) -> None:
        """The paged pool once a step's releases gave their blocks back (every rank: each runner has its own
        series). GET /metrics reads the newest kv_usage record (api/runner_metrics.py), which the prefills' starts
        alone would leave at its busiest once traffic stops. Once per step that released, never per token; in the
        phase the rank is in, so the record moves no phase."""
        usage = getattr(self.engine, "kv_usage", dict)()
        if usage:
            self.recorder.record(self.recorder.phase, "kv_released", released=released, **usage)
