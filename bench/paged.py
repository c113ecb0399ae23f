"""The paged KV cache and what it enables, measured in one run (CPU, in-process).

On the ~100M random Llama (int4 at load, as issue 32 asks), every figure side by side in the same run:
  KV bytes per token: the pool's bytes ÷ its positions against the model's theoretical 2 x layers x kv heads x
    head_dim x dtype bytes                                                            (target within 5 %)
  many streams: decode tok/s of 32 concurrent streams ÷ one stream                     (target >= 8, or where it
    saturates)
  a shared prefix: ten chats whose prompts share a 2,000-token system prompt, the peak KV blocks held ÷ one
    chat's                                                                             (target <= 1.5)
With --model-dir (a real checkpoint, e.g. SmolLM2-135M-Instruct; nothing is downloaded):
  speculative decoding: greedy tok/s with prompt-lookup drafts ÷ without, on a code-editing prompt whose answer
    repeats much of the prompt, and the drafts' acceptance                              (target >= 1.5)
  long prompts: prefill tok/s at --lengths (default 512, 4096) with max_position_embeddings raised to fit the
    longest, and decode tok/s after it

Run: .venv/bin/python bench/paged.py [--rounds 3] [--threads 2] [--model-dir DIR] [--lengths 512,4096,32768]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from skulk.engines.torch.blocks import blocks_for
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.types.chat import ChatMessage, SamplingParams

STREAMS = 32
SYSTEM, CHATS = 2000, 10
CODE = '''def moving_average(values, window):
    """Average of each window of consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            averages.append(total / window)
    return averages


def report(name, values, window=3):
    averages = moving_average(values, window)
    for index, average in enumerate(averages):
        print(f"{name} {index}: {average:.2f}")
    return averages
'''
EDIT = ("Rename the function moving_average to rolling_mean everywhere in this code and change nothing else. "
        "Reply with the whole code.\n\n```python\n" + CODE + "```\n")


def forced(where: str, req: Any) -> int | None:
    """Streams emit a fixed token (no early end on the random model's EOS; no speculation: a hook is set)."""
    return 65 if where == "sample" else None


def decode_tps(engine: TorchEngine, streams: int, tokens: int) -> float:
    """Decode tok/s of `streams` concurrent 16-token prompts, timed after all are prefilled."""
    for i in range(streams):
        engine.add_request(f"s{i}", [258, *range(40 + i, 55 + i)], SamplingParams(max_tokens=tokens, temperature=0))
    done = 0
    while done < streams:  # prefill and first tokens
        done += len(engine.step())
    started, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - started)


def shared_prefix(model_dir: Path) -> tuple[int, int]:
    """(peak blocks held by ten chats sharing a system prompt, blocks one such chat holds)."""
    engine = TorchEngine(model_dir, quantize="int4", max_seq=2200, speculate=False)
    system = [258, *(32 + (7 * i) % 90 for i in range(SYSTEM - 1))]
    sampling = SamplingParams(max_tokens=8, temperature=0)
    engine.add_request("c0", [*system, *b"hello?"], sampling)
    while not engine.step():
        pass
    for i in range(1, CHATS):
        engine.add_request(f"c{i}", [*system, *f"question {i}?".encode()], sampling)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.blocks.held)
    return peak, blocks_for(SYSTEM + 6 + sampling.max_tokens, engine.block_size)


def bench_model(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_builtin_model(BENCH_MODEL_ID, Path(tmp))
        engine = TorchEngine(model_dir, quantize="int4", max_seq=512, speculate=False)
        args_ = engine.model.args
        theory = 2 * args_.num_hidden_layers * args_.num_key_value_heads * args_.head_dim * 2
        measured = engine.cache.nbytes / (engine.blocks.num_blocks * engine.block_size)
        print(f"KV bytes per token: {measured:.0f} (theory {theory}, ratio {measured / theory:.3f})")
        engine.fault_hook = forced
        decode_tps(engine, 2, 4)  # warm
        ratios = []
        for round_ in range(args.rounds):
            one = decode_tps(engine, 1, 32)
            many = decode_tps(engine, STREAMS, 32)
            ratios.append(many / one)
            print(f"round {round_}: 1 stream {one:6.1f} tok/s, {STREAMS} streams {many:7.1f} tok/s")
        print(f"{STREAMS} streams ÷ 1 (100M int4): {statistics.median(ratios):.2f} (target >= 8)")
        peak, one_chat = shared_prefix(model_dir)
        print(f"ten chats sharing a {SYSTEM}-token system prompt: peak {peak} blocks held, one chat {one_chat}: "
              f"ratio {peak / one_chat:.2f} (target <= 1.5)")


def speculation(model_dir: Path, rounds: int) -> None:
    tokenizer = TorchEngine(model_dir, max_seq=2048, kv_cache_bytes=0)
    prompt = tokenizer.encode_chat([ChatMessage(role="user", content=EDIT)])
    sampling = SamplingParams(max_tokens=200, temperature=0)
    engines = {on: TorchEngine(model_dir, max_seq=2048, speculate=on) for on in (False, True)}
    speeds: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[int]] = {}
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the runner's "MTP acceptance" line
    for round_ in range(rounds + 1):  # the first round warms up
        for on, engine in engines.items():
            engine.add_request(f"r{round_}", prompt, sampling)
            tokens: list[int] = []
            while not tokens:
                tokens += [o.token_id for o in engine.step()]
            started = time.perf_counter()
            while engine.has_work():
                tokens += [o.token_id for o in engine.step()]
            if round_:
                speeds[on].append((len(tokens) - 1) / (time.perf_counter() - started))
            outputs[on] = tokens
    same = outputs[True] == outputs[False]
    ratio = statistics.median(s / p for s, p in zip(speeds[True], speeds[False], strict=True))
    print(f"speculative decoding on a {len(prompt)}-token code edit, {len(outputs[True])} tokens: plain "
          f"{statistics.median(speeds[False]):.1f} tok/s, prompt lookup {statistics.median(speeds[True]):.1f} "
          f"tok/s, ratio {ratio:.2f} (target >= 1.5); identical output: {same}")


def long_prompts(model_dir: Path, lengths: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        raised = Path(tmp) / "raised"
        raised.mkdir()
        for item in model_dir.iterdir():
            (raised / item.name).symlink_to(item)
        config = json.loads((model_dir / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max(lengths) + 64)
        (raised / "config.json").unlink()
        (raised / "config.json").write_text(json.dumps(config))
        for length in lengths:
            engine = TorchEngine(raised, prefill_chunk=512, speculate=False, kv_cache_bytes=0)
            engine.add_request("long", [1, *(100 + i % 5000 for i in range(length - 1))],
                               SamplingParams(max_tokens=17, temperature=0))
            started = time.perf_counter()
            while not engine.step():
                pass
            prefill = time.perf_counter() - started
            started, produced = time.perf_counter(), 0
            while engine.has_work():
                produced += len(engine.step())
            print(f"{length:6}-token prompt: prefill {length / prefill:7.1f} tok/s, then decode "
                  f"{produced / (time.perf_counter() - started):6.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--only", choices=["bench", "real"], help="run only the 100M figures or the real model's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "real":
        bench_model(args)
    if args.model_dir is not None and args.only != "bench":
        speculation(args.model_dir, args.rounds)
        long_prompts(args.model_dir, [int(n) for n in args.lengths.split(",")])


if __name__ == "__main__":
    main()
