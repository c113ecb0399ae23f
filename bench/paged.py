"""The paged KV cache and what it enables, measured in one run (CPU, in-process).

On the ~100M random Llama (int4 at load, as issue 32 asks), every figure side by side in the same run:
  KV bytes per token: the pool's bytes ÷ its positions against the model's theoretical 2 x layers x kv heads x
    head_dim x dtype bytes                                                            (target within 5 %)
  many streams: decode tok/s of 32 concurrent streams ÷ one stream                     (target >= 8, or where it
    saturates), on the quantized kernels as they are and, in the same rounds, with the AMX kernel off (the 512-bit
    VNNI kernels for every row count, as before it: "before"; the same kernels both ways where there is no AMX)
  --profile: ms per part of one decode step at 1, 8, 16 and 32 streams (bench/step_profile.py), both ways
  a shared prefix: ten chats whose prompts share a 2,000-token system prompt, the peak KV blocks held ÷ one
    chat's                                                                             (target <= 1.5)
With --model-dir (a real checkpoint, e.g. SmolLM2-135M-Instruct; nothing is downloaded):
  speculative decoding: greedy tok/s with prompt-lookup drafts ÷ without, on a code-editing prompt whose answer
    repeats much of the prompt, and the drafts' acceptance                              (target >= 1.5)
  long prompts: prefill tok/s at --lengths (default 512, 4096) with max_position_embeddings raised to fit the
    longest, and decode tok/s after it

Run: .venv/bin/python bench/paged.py [--rounds 3] [--threads 2] [--model-dir DIR] [--lengths 512,4096,32768]
                                    [--profile] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import step_profile
from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.blocks import blocks_for
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model
from skulk.types.chat import ChatMessage, SamplingParams

STREAMS = 32
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = "wall"
"""--clock cpu: the streams' figures in the process's CPU time, which other load on a shared machine does not
inflate (with --threads 1; more threads count their spinning too)."""
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


def decode_tps(engine: TorchEngine, streams: int, steps: int) -> float:
    """Decode tok/s of `streams` concurrent 16-token prompts over `steps` steps with every one running past its
    prompt (the scheduler admits a burst over several steps: timing from the first `streams` tokens, as this did
    before, timed prefills and a tail of fewer streams too)."""
    step_profile.fill(engine, streams)
    started, produced = CLOCKS[CLOCK](), 0
    for _ in range(steps):
        produced += len(engine.step())
    seconds = CLOCKS[CLOCK]() - started
    step_profile.empty(engine)
    return produced / seconds


@contextlib.contextmanager
def amx_kernel(on: bool) -> Iterator[None]:
    """The quantized matmuls' AMX kernel on (from cpu_kernels.AMX_ROWS rows, as shipped) or off (the 512-bit VNNI
    kernels for every row count, as before it); where it does not run (no AMX, SKULK_AMX=0), both ways are the
    VNNI kernels."""
    before = cpu_kernels.amx_rows()
    if before:
        cpu_kernels.amx_rows(before if on else 1 << 30)
    try:
        yield
    finally:
        if before:
            cpu_kernels.amx_rows(before)


def profile(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_builtin_model(BENCH_MODEL_ID, Path(tmp))
        for amx in (False, True):
            engine = TorchEngine(model_dir, quantize="int4", max_seq=512, speculate=False)
            engine.tokenizer.eos_ids = frozenset()  # every row decodes its whole max_tokens
            with amx_kernel(amx):
                rows = step_profile.profile(engine)
            print(f"ms per decode step (CPU time), 100M int4, {args.threads} thread(s), "
                  f"{'AMX kernel (now)' if amx else 'VNNI kernels (before)'}:")
            step_profile.print_table(rows)


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
        ratios: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for amx in (False, True):
                with amx_kernel(amx):
                    one = decode_tps(engine, 1, 128)  # long enough that one noisy moment does not decide it
                    many = decode_tps(engine, STREAMS, 64)
                ratios[amx].append(many / one)
                print(f"round {round_}, {'now' if amx else 'before'}: 1 stream {one:6.1f} tok/s, {STREAMS} streams "
                      f"{many:7.1f} tok/s, ratio {many / one:.2f}")
        print(f"{STREAMS} streams ÷ 1 (100M int4): before {statistics.median(ratios[False]):.2f}, now "
              f"{statistics.median(ratios[True]):.2f} (target >= 8)")
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
    parser.add_argument("--profile", action="store_true", help="only the table of ms per part of a decode step")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args)
        return
    if args.only != "real":
        bench_model(args)
    if args.model_dir is not None and args.only != "bench":
        speculation(args.model_dir, args.rounds)
        long_prompts(args.model_dir, [int(n) for n in args.lengths.split(",")])


if __name__ == "__main__":
    main()
