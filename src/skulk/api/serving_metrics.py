"""The request path's Prometheus metrics: HTTP requests by route and status, and one record per generation.

Every text API's generation passes through api/chat_session.py (`start_chat`, then `ChatSession.chunks`), so a
`Generation` is opened there and observed once when it ends: its tokens, time to first token and mean gap
between tokens. Per token the chat loop only adds one to an int (`Generation.tokens`): no lock, no histogram, no
I/O; the histograms and counters are touched once per request. The metric objects are built unregistered, and
api/metrics.py registers them in its app's registry, next to the scrape-time node collector.

Labels: `model` (only models the cluster serves reach a Generation: start_chat refuses an unknown one before,
so a client cannot mint series), `instance_id` (the placed instance that ran the task, "" where the state does
not say yet; not `instance`, which Prometheus gives the scrape target and would rename ours to
`exported_instance`), and the route's template (never the raw path: a 404 scan would otherwise grow the series
without end; a request refused before routing, by the Host or key checks, counts as UNMATCHED).
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skulk.types.state import State

# Seconds. TTFT spans prompt processing on a split model (tens of ms to minutes); a token gap is ms to seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
UNMATCHED = "unmatched"
"""The route label of a request no route matched (a 404, a refused Host or key): one series, whatever the path."""


class ServingMetrics:
    """One node's metrics counted as things happen (the request path, the store server's bytes, the masters it
    followed), unlike api/metrics.py's NodeCollector, which reads state at scrape time. A set per node (and per
    ApiServices in tests), so several apps in one process stay apart; prometheus_client's metrics are
    thread-safe, which the store server's threads need."""

    def __init__(self) -> None:
        model = ["model", "instance_id"]
        self.requests = Counter("skulk_http_requests", "HTTP requests answered, by route template and status.",
                                ["route", "method", "status"], registry=None)
        self.generations = Counter("skulk_generations", "Generations ended, by how: stop, length, error, "
                                   "cancelled (the client left).",
                                   [*model, "outcome"], registry=None)
        self.prompt_tokens = Counter("skulk_prompt_tokens", "Prompt tokens of the generations that finished.",
                                     model, registry=None)
        self.generated_tokens = Counter("skulk_generated_tokens", "Tokens generated, cancelled generations "
                                        "included.", model, registry=None)
        self.ttft = Histogram("skulk_time_to_first_token_seconds", "From the request's start to its first token.",
                              model, buckets=TTFT_BUCKETS, registry=None)
        self.itl = Histogram("skulk_inter_token_latency_seconds", "A generation's mean gap between tokens after "
                             "the first (one observation per generation of two tokens or more).",
                             model, buckets=ITL_BUCKETS, registry=None)
        self.active = Gauge("skulk_active_streams", "Generations admitted and not yet ended.", ["model"],
                            registry=None)
        self.store_bytes = Counter("skulk_store_served_bytes", "Model file bytes this node's store server sent "
                                   "to stagers (store host only).", registry=None)
        self.master_changes = Counter("skulk_master_changes", "Masters (new master or new term) this node has "
                                      "followed: one per election it saw.", registry=None)

    def collectors(self) -> tuple[Collector, ...]:
        return (self.requests, self.generations, self.prompt_tokens, self.generated_tokens, self.ttft, self.itl,
                self.active, self.store_bytes, self.master_changes)


def instance_of(state: State, command_id: str) -> str:
    """The instance whose task runs `command_id`, "" when the state has no such task (yet, or any more)."""
    return next((str(t.instance_id) for t in state.tasks.values() if t.command_id == command_id), "")


class Generation:
    """One admitted generation: opened by start_chat, counted by the chat loop, observed once by `end`."""

    __slots__ = ("_ended", "_metrics", "first_at", "instance", "model", "started", "tokens")

    def __init__(self, metrics: ServingMetrics, model: str) -> None:
        self._metrics, self.model, self.instance = metrics, model, ""
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.tokens = 0
        """Token chunks seen: each carries one token (TokenChunk.token_id)."""
        self._ended = False
        metrics.active.labels(model).inc()

    def first(self, instance: str) -> None:
        self.first_at, self.instance, self.tokens = time.monotonic(), instance, 1

    def end(self, outcome: str, prompt_tokens: int = 0, completion_tokens: int | None = None) -> None:
        """Idempotent: the first call counts (a finished stream's close after its last chunk adds nothing)."""
        if self._ended:
            return
        self._ended = True
        metrics, labels = self._metrics, (self.model, self.instance)
        metrics.active.labels(self.model).dec()
        metrics.generations.labels(*labels, outcome).inc()
        if prompt_tokens:
            metrics.prompt_tokens.labels(*labels).inc(prompt_tokens)
        generated = completion_tokens if completion_tokens is not None else self.tokens
        if generated:
            metrics.generated_tokens.labels(*labels).inc(generated)
        if self.first_at is None:
            return
        metrics.ttft.labels(*labels).observe(self.first_at - self.started)
        if self.tokens > 1:
            metrics.itl.labels(*labels).observe((time.monotonic() - self.first_at) / (self.tokens - 1))


def route_label(scope: Scope) -> str:
    """The matched route's template (FastAPI puts the route in the scope), else UNMATCHED."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class RequestCountMiddleware:
    """Counts each HTTP request once, when its response starts (a stream counts at its first byte, with the status
    it began with); a request that raised before answering counts as 500. Outermost, so refusals count too."""

    def __init__(self, app: ASGIApp, *, metrics: ServingMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def counted_send(message: Message) -> None:
            nonlocal status
            if status is None and message["type"] == "http.response.start":
                status = int(message["status"])
                self._count(scope, status)
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except BaseException:
            if status is None:
                self._count(scope, 500)
            raise

    def _count(self, scope: Scope, status: int) -> None:
        self.metrics.requests.labels(route_label(scope), str(scope.get("method", "")), str(status)).inc()
