"""The MLX engine beside mlx-lm's own generation on the same model, in one run (issue 30's targets).

What our engine adds around mlx-lm (request bookkeeping, the shared sampler, continuous batching over mlx-lm's
BatchKVCache) is measured against mlx-lm driving the same model itself, interleaved over --rounds (medians of
each round's own ratio):
  single stream: our decode tok/s ÷ mlx_lm.stream_generate's (greedy, same prompt and token count)  target >= 0.9
  8 streams:     our aggregate decode tok/s ÷ mlx_lm.batch_generate's generation tok/s             target >= 1.0
  and the torch engine's single-stream decode on the same checkpoint, for scale.
On Linux this is MLX's CPU backend (slow next to torch's kernels here); the figures that matter are a Mac's, on
Metal, which this machine cannot measure: run the same command there.

Run: .venv/bin/python bench/mlx_engine.py [--rounds 3] [--tokens 48] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import batch_generate, stream_generate
from mlx_lm.tokenizer_utils import load as load_tokenizer

from skulk.engines.mlx.engine import MlxEngine
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import generate_random_llama
from skulk.types.chat import SamplingParams

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 10] * 2
STREAMS = 8


def write_model(root: Path, hidden: int, layers: int) -> Path:
    """A random Llama with the byte tokenizer and no end token (so every run decodes every token asked for)."""
    path = generate_random_llama(root / "m", hidden_size=hidden, n_layers=layers, n_heads=hidden // 64,
                                 n_kv_heads=max(1, hidden // 128), intermediate_size=hidden * 4, seed=11)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink()
    model_config = json.loads((path / "config.json").read_text())
    model_config.pop("eos_token_id", None)
    (path / "config.json").write_text(json.dumps(model_config))
    return path


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second after the first token (prefill excluded), as mlx-lm's generation_tps counts them."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ours_single(engine: Any, tokens: int) -> float:
    engine.add_request("one", PROMPT, SamplingParams(max_tokens=tokens, temperature=0))
    stamps: list[float] = []
    while engine.has_work():
        stamps += [time.perf_counter() for _ in engine.step()]
    return decode_rate(stamps)


def ours_batched(engine: MlxEngine, tokens: int) -> float:
    """Aggregate decode tok/s once every stream has its first token (prefills excluded, as mlx-lm excludes them)."""
    for i in range(STREAMS):
        engine.add_request(f"s{i}", [*PROMPT, i], SamplingParams(max_tokens=tokens, temperature=0))
    seen: set[str] = set()
    started, counted = 0.0, 0
    while engine.has_work():
        outs = engine.step()
        if len(seen) == STREAMS:
            counted += len(outs)
        seen |= {o.request_id for o in outs}
        if len(seen) == STREAMS and not started:
            started = time.perf_counter()
    return counted / (time.perf_counter() - started)


def mlx_lm_single(model: Any, tokenizer: Any, tokens: int) -> float:
    stamps = [time.perf_counter() for _ in stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=tokens)]
    return decode_rate(stamps)


def mlx_lm_batched(model: Any, tokenizer: Any, tokens: int) -> float:
    prompts = [[*PROMPT, i] for i in range(STREAMS)]
    return float(batch_generate(model, tokenizer, prompts, max_tokens=tokens).stats.generation_tps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp), args.hidden, args.layers)
        ours = MlxEngine(path, max_batch=STREAMS)
        ours.warmup()
        tokenizer = load_tokenizer(path)
        torch_engine = TorchEngine(path, max_batch=STREAMS)
        torch_engine.warmup()
        rows: dict[str, list[float]] = {k: [] for k in ("ours1", "lm1", "ours8", "lm8", "torch1")}
        runs: dict[str, Callable[[], float]] = {
            "ours1": lambda: ours_single(ours, args.tokens),
            "lm1": lambda: mlx_lm_single(ours.model, tokenizer, args.tokens),
            "ours8": lambda: ours_batched(ours, args.tokens),
            "lm8": lambda: mlx_lm_batched(ours.model, tokenizer, args.tokens),
        }
        for round_ in range(args.rounds):  # ABBA: which side runs first alternates, so a trend favours neither
            for pair in (("ours1", "lm1"), ("ours8", "lm8")):
                for key in pair if round_ % 2 == 0 else pair[::-1]:
                    rows[key].append(runs[key]())
            rows["torch1"].append(ours_single(torch_engine, args.tokens))
        med = {k: statistics.median(v) for k, v in rows.items()}
        singles = [a / b for a, b in zip(rows["ours1"], rows["lm1"], strict=True)]
        batches = [a / b for a, b in zip(rows["ours8"], rows["lm8"], strict=True)]
        single, batched = statistics.median(singles), statistics.median(batches)
        device = "Metal" if mx.metal.is_available() else "CPU"
        print(f"model: random Llama hidden {args.hidden}, {args.layers} layers, f32; MLX on {device}; "
              f"{args.tokens} tokens, {args.rounds} rounds (medians)")
        print(f"  1 stream   ours {med['ours1']:8.1f} tok/s   mlx_lm.stream_generate {med['lm1']:8.1f}   "
              f"ratio {single:.2f} (target >= 0.9)")
        print(f"  {STREAMS} streams  ours {med['ours8']:8.1f} tok/s   mlx_lm.batch_generate  {med['lm8']:8.1f}   "
              f"ratio {batched:.2f} (target >= 1.0)")
        print(f"  torch engine, 1 stream, same checkpoint: {med['torch1']:.1f} tok/s")
        print(f"  each round's ratios (a loaded machine spreads them): 1 stream {' '.join(f'{r:.2f}' for r in singles)}"
              f"; {STREAMS} streams {' '.join(f'{r:.2f}' for r in batches)}; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
