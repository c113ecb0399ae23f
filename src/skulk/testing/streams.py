"""Streamed chat completions from a client's seat: decode timing for benchmarks, and background streams
whose ending (completed, one error event, broken, hung) chaos tests and benchmarks assert on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx


def stream_chunk(line: str) -> int | None:
    """One line of an OpenAI chat stream (with include_usage): None when it is no chunk, -1 for a token chunk,
    else the final usage chunk's completion_tokens; an error chunk raises. The one parser the streaming clients
    of benches and tests share."""
    if not line.startswith("data: {"):
        return None
    payload = json.loads(line[6:])
    if "error" in payload:
        raise RuntimeError(f"stream failed: {payload['error']}")
    if payload.get("choices") == [] and "usage" in payload:
        return int(payload["usage"]["completion_tokens"])
    return -1


def decode_tokens_per_s(url: str, model: str, prompt: str, tokens: int, timeout: float = 600) -> float:
    """Greedy decode speed of one stream: tokens after the first over the time from first to last token."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = 0.0
    produced = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout, trust_env=False) as reply:
        for line in reply.iter_lines():
            chunk = stream_chunk(line)
            if chunk is None:
                continue
            if chunk >= 0:
                produced = chunk
                continue
            last = time.perf_counter()
            first = first or last
    if produced < 2 or last <= first:
        raise RuntimeError(f"too few tokens streamed to time decode ({produced})")
    return (produced - 1) / (last - first)


@dataclass
class StreamOutcome:
    """How one streamed chat completion went, as its client saw it (monotonic times)."""

    started: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    done: bool = False
    status: int | None = None
    error: dict[str, Any] | None = None
    broken: str | None = None
    last_token: float | None = None
    longest_gap: float = 0.0
    """Longest silence between two tokens: a stream that stalls and then completes is not hung, but slowed."""

    @property
    def kind(self) -> str:
        """completed | error | http <status> | broken | open: what a client would have to do next."""
        if self.ended is None:
            return "open"
        if self.status is not None and self.status != 200:
            return f"http {self.status}"
        if self.broken is not None:
            return "broken"
        if self.error is not None:
            return "error"
        return "completed" if self.done else "broken"

    @property
    def retryable_error(self) -> bool:
        """Ended as the contract allows for a fault: one error event marked retryable, or, before the first
        token (when errors are plain HTTP errors), a 503, which tells any client to retry."""
        if self.kind == "http 503":
            return True
        return self.kind == "error" and bool(self.error and self.error.get("retryable"))

    def describe(self) -> str:
        detail = self.error or self.broken or ""
        return f"{self.kind} after {self.tokens} tokens {detail}".strip()


def chat_body(model: str, tokens: int, prompt: str = "tell me a story", temperature: float = 1.0) -> dict[str, Any]:
    """A streamed request. At temperature 1 a random-weights model may sample its end token early (the demo model
    does after 50-311 tokens on this prompt); where a stream must run to `tokens`, pass temperature=0: greedy, the
    demo model writes every token asked for."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": temperature,
        "stream": True,
    }


def consume(url: str, body: dict[str, Any], outcome: StreamOutcome, read_timeout: float = 30.0) -> StreamOutcome:
    """Read one stream to its end into `outcome`; never raises, so a failure is a recorded outcome.

    The read timeout is the client's patience between two chunks: a stream that goes silent for longer is
    recorded as broken (hung), which is exactly what the chaos contract forbids."""
    timeout = httpx.Timeout(10.0, read=read_timeout)
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout, trust_env=False) as reply:
            outcome.status = reply.status_code
            if reply.status_code != 200:
                reply.read()
                outcome.error = _error_of(reply.text)
                return outcome
            for line in reply.iter_lines():
                _take_line(line, outcome)
                if outcome.done:
                    break
    except (httpx.HTTPError, OSError) as exc:
        outcome.broken = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()
    return outcome


def _take_line(line: str, outcome: StreamOutcome) -> None:
    if line == "data: [DONE]":
        outcome.done = True
        return
    if not line.startswith("data: {"):
        return
    payload = json.loads(line[6:])
    if "error" in payload:
        outcome.error = payload["error"]
    elif payload.get("choices"):
        now = time.monotonic()
        outcome.tokens += 1
        outcome.first_token = outcome.first_token or now
        if outcome.last_token is not None:
            outcome.longest_gap = max(outcome.longest_gap, now - outcome.last_token)
        outcome.last_token = now


def _error_of(text: str) -> dict[str, Any]:
    try:
        return dict(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return {"message": text[:200]}


class StreamProbe:
    """One stream read on a background thread, so a test can inflict a fault while it is open.

    `setup` runs first on that thread: e.g. netns.enter, for a node only reachable inside a namespace."""

    def __init__(
        self, url: str, body: dict[str, Any], read_timeout: float = 30.0, setup: Callable[[], None] | None = None
    ) -> None:
        self.outcome = StreamOutcome(started=time.monotonic())
        self._args = (url, body, read_timeout, setup)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url, body, read_timeout, setup = self._args
        if setup is not None:
            setup()
        consume(url, body, self.outcome, read_timeout)

    def wait_tokens(self, count: int, timeout: float) -> None:
        """Block until the stream is well into decode (not racing its prefill) or has ended."""
        deadline = time.monotonic() + timeout
        while self.outcome.tokens < count and self.outcome.ended is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"stream produced {self.outcome.tokens} tokens in {timeout:.0f} s")
            time.sleep(0.02)

    def wait(self, timeout: float) -> StreamOutcome:
        self._thread.join(timeout)
        return self.outcome


FAILED_STREAM_BACKOFF_S = 0.5


class StreamLoop:
    """Streams back to back on a background thread until stopped: covers a fault window of any length
    with short streams, each of which must complete (a stream that errors shows the fault reached it)."""

    def __init__(
        self, url: str, body: dict[str, Any], read_timeout: float = 30.0, setup: Callable[[], None] | None = None
    ) -> None:
        self.outcomes: list[StreamOutcome] = []
        self._stop = threading.Event()
        self._args = (url, body, read_timeout, setup)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        url, body, read_timeout, setup = self._args
        if setup is not None:
            setup()
        while not self._stop.is_set():
            outcome = StreamOutcome(started=time.monotonic())
            self.outcomes.append(outcome)
            consume(url, body, outcome, read_timeout)
            if outcome.kind != "completed":
                self._stop.wait(FAILED_STREAM_BACKOFF_S)  # a retry storm would count one failure many times

    def stop(self, timeout: float = 60.0) -> list[StreamOutcome]:
        """Let the stream in flight finish, then return every outcome (the thread is gone when this returns)."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"a stream was still open {timeout:.0f} s after the loop was stopped")
        return list(self.outcomes)


def open_long_stream(url: str, model: str, attempts: int = 3) -> StreamProbe:
    """A stream well into decode that will not end on its own while a fault is injected: greedy, because sampled
    at temperature 1 the demo model stops on its end token within 60 tokens about a third of the time (a stream
    that had ended by itself before a kill landed failed the chaos contract), while its greedy reply runs the
    whole 1900 tokens; tried again if it has ended anyway."""
    for _ in range(attempts):
        probe = StreamProbe(url, chat_body(model, 1900, temperature=0.0), read_timeout=30)
        probe.wait_tokens(5, 30)
        if probe.outcome.ended is None:
            return probe
    raise AssertionError(f"no stream stayed open past 5 tokens in {attempts} attempts")
