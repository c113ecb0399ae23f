"""Timing one streamed chat completion from a client's seat, for benchmarks."""

from __future__ import annotations

import json
import time

import httpx


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
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"stream failed: {payload['error']}")
            if payload.get("choices") == [] and "usage" in payload:
                produced = payload["usage"]["completion_tokens"]
                continue
            last = time.perf_counter()
            first = first or last
    if produced < 2 or last <= first:
        raise RuntimeError(f"too few tokens streamed to time decode ({produced})")
    return (produced - 1) / (last - first)
