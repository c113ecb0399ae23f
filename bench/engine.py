"""The engine's forward path per weight format, side by side with llama.cpp in one run, on a random ~500M Llama.

The model is issue 14's reference shape (vocab 32768, hidden 1024, 24 layers, 16/8 heads, ffn 4864), written
once as a bf16 checkpoint and loaded as f32, f16, bf16, and quantized at load to int8 and int4 (weight-only
kernels, bf16 activations). For each format, interleaved over --rounds so noise hits all alike (medians):
  decode tok/s of one greedy stream (a batched forward of one row with the KV cache, as the engine steps)
  decode tok/s of 8 streams together ÷ one stream                                    (target >= 3)
  8 streams on the paged cache (blocks of PAGE positions, scattered over the pool) ÷ on one contiguous block
  per stream (the layout before paging)                                              (target >= 0.95)
  prefill tok/s of a 512-token prompt
  weight bytes in memory
  per-step Python overhead: the decode step time of a model with the same structure and tiny weights (hidden 64,
  ffn 64, vocab 256, head_dim 8: the same ops per step, next to no arithmetic) as a % of the 500M step
  (target < 5 %)
When llama-cpp-python and gguf are installed (not dependencies:
  CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python gguf ), the same checkpoint is converted
to GGUF f16, bf16, q8_0 and Q4_0 (bench/llama_cpp_side.py) and llama.cpp's decode (greedy, single stream, same
prompt and token count) and prefill (same 512 tokens) run in the same rounds, with ours ÷ llama.cpp per bit width:
f16↔f16, bf16↔bf16, int8↔q8_0, int4↔Q4_0 (targets: decode >= 0.9 everywhere, prefill >= 0.9 at f16/bf16).

Run: .venv/bin/python bench/engine.py [--rounds 3] [--tokens 32] [--threads 2] [--formats f16,int4] [--no-llama]
                                  [--clock wall|cpu] [--context 16]
     (formats: f32 f16 bf16 int8 int4, f16-native / bf16-native: see NATIVE, *-avx2: see AVX2,
      *-head16: see HEAD16)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import llama_cpp_side
from skulk.engines.torch import cpu_kernels, matmul
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models import read_args

SHAPE = {"vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
         "num_key_value_heads": 8, "intermediate_size": 4864}
TINY = {**SHAPE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "head_dim": 8}
FORMATS = {"f32": {"dtype": "float32"}, "f16": {"dtype": "float16"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}
NATIVE = "-native"
"""A format named f16-native / bf16-native runs every matmul in its own dtype (engines/torch/matmul.py's f32
GEMM for many rows switched off): the before/after of that path, measured in the same rounds."""
AVX2 = "-avx2"
"""A format named bf16-avx2 / int8-avx2 / int4-avx2 runs what a CPU with AVX2 alone runs, on a CPU that has more:
the kernels built without extensions (cpu_kernels.extension_flags: VNNI, AVX-512 BF16) and bf16 prefill as an f32
GEMM (matmul.native_bf16_gemm), side by side with the vpdpbusd / vdpbf16ps / bf16-GEMM paths."""
HEAD16 = "-head16"
"""A format named bf16-head16 / int4-head16 rounds the head's logits to the activations' dtype before they are
widened to f32 (what the engine did before issue 41: lm_head's out_dtype unset), side by side with the f32 head's
output the engine keeps now: the decode cost of unrounded logits, measured in the same rounds."""
PREFILL = 512
PAGE = 32  # engine.DEFAULT_BLOCK_SIZE
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter
"""--clock cpu times with the process's CPU time instead of the wall clock: with --threads 1 on a shared, loaded
machine that leaves out the time other processes held the core (barrier spinning still counts with more threads)."""


def write_model(path: Path, shape: dict[str, int]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A random bf16 Llama checkpoint of `shape` at path; returns its config and weights."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", **shape}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    model = ModelSlice(read_args(config))
    generator = torch.Generator().manual_seed(0)
    weights = {f"model.{n}" if not n.startswith("lm_head") else n:
               (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16)
               for n, t in model.state_dict().items()}
    for name in weights:
        if "norm" in name:
            weights[name] = torch.ones_like(weights[name])
    save_file(weights, str(path / "model.safetensors"))
    return config, weights


def decode_tps(model: ModelSlice, streams: int, tokens: int, block: int | None = None, prompt: int = 16) -> float:
    """Greedy decode of `streams` rows after a `prompt`-token prefill; block: a paged cache of blocks of that many
    positions, each stream's blocks shuffled over the pool as a long-running server's are (None: one contiguous
    block per stream)."""
    size = prompt + tokens
    if block is None:
        cache, tables = model.make_cache(streams, size), torch.arange(streams, dtype=torch.int32).view(streams, 1)
    else:
        per = -(-size // block)
        cache = model.make_cache(streams * per, block)
        order = torch.randperm(streams * per, generator=torch.Generator().manual_seed(1))
        tables = order.to(torch.int32).view(streams, per)
    with torch.inference_mode():
        ids = torch.randint(0, model.args.vocab_size, (streams, prompt))
        model(ids, StepBatch.build(torch.arange(prompt).repeat(streams, 1), tables), cache, last_only=True)
        next_ids = torch.zeros(streams, 1, dtype=torch.long)
        start = clock()
        for step in range(tokens):
            positions = torch.full((streams, 1), prompt + step)
            logits = model(next_ids, StepBatch.build(positions, tables, kv_len=prompt + step + 1), cache)
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
    return streams * tokens / (clock() - start)


def prefill_tps(model: ModelSlice, length: int = PREFILL) -> float:
    cache = model.make_cache(1, length)
    with torch.inference_mode():
        ids = torch.randint(0, model.args.vocab_size, (1, length))
        start = clock()
        model(ids, StepBatch.build(torch.arange(length).unsqueeze(0), 0, kv_len=length), cache, last_only=True)
    return length / (clock() - start)


def base_format(name: str) -> str:
    """The FORMATS entry a format name loads (f16 for f16-native, int4 for int4-avx2)."""
    return name.removesuffix(HEAD16).removesuffix(NATIVE).removesuffix(AVX2)


@contextlib.contextmanager
def matmuls_for(name: str) -> Iterator[None]:
    """Inside: the matmul paths the format `name` asks for (its own dtype only for a -native name; for an -avx2
    one what a CPU with AVX2 alone runs: our kernels without extensions, no bf16 GEMM of torch's)."""
    saved_rows, saved_bf16 = matmul.FLOAT_GEMM_ROWS, matmul.native_bf16_gemm
    matmul.FLOAT_GEMM_ROWS = sys.maxsize if name.endswith(NATIVE) else saved_rows
    if name.endswith(AVX2):
        matmul.native_bf16_gemm = lambda: False  # type: ignore[assignment]
    cpu_kernels.set_enabled(True, extensions=not name.endswith(AVX2))
    try:
        yield
    finally:
        matmul.FLOAT_GEMM_ROWS, matmul.native_bf16_gemm = saved_rows, saved_bf16
        cpu_kernels.set_enabled(True)


@contextlib.contextmanager
def head_for(name: str, *models: ModelSlice) -> Iterator[None]:
    """Inside: for a -head16 name, the models' lm_head returning the activations' dtype (then widened) instead of
    its f32 accumulator."""
    heads = [m.lm_head for m in models if m.lm_head is not None] if name.endswith(HEAD16) else []
    saved = [head.out_dtype for head in heads]
    for head in heads:
        head.out_dtype = None
    try:
        yield
    finally:
        for head, dtype in zip(heads, saved, strict=True):
            head.out_dtype = dtype


def weight_bytes(model: ModelSlice) -> int:
    """Bytes of distinct storage (a stacked q/k/v and the q_proj/k_proj/v_proj views of it count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def load_ours(root: Path, formats: list[str]) -> tuple[dict[str, ModelSlice], dict[str, ModelSlice]]:
    """The 500M and the tiny model per format; f16-native shares f16's model (only the matmul path differs)."""
    loaded: dict[str, tuple[ModelSlice, ModelSlice]] = {}
    for base in dict.fromkeys(base_format(f) for f in formats):
        options: dict[str, Any] = FORMATS[base]
        loaded[base] = (load_model(root / "m", **options), load_model(root / "tiny", **options))
    return ({f: loaded[base_format(f)][0] for f in formats},
            {f: loaded[base_format(f)][1] for f in formats})


def load_llama_cpp(root: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], formats: list[str],
                   threads: int) -> dict[str, llama_cpp_side.LlamaCpp]:
    """The GGUF counterpart of each of our formats that has one, loaded in llama.cpp."""
    wanted = {llama_cpp_side.PAIRS[f] for f in formats if f in llama_cpp_side.PAIRS}
    paths: dict[str, Path] = {}
    if wanted & {"f16", "q8_0", "Q4_0"}:
        paths["f16"] = llama_cpp_side.write_gguf(weights, config, root / "m-f16.gguf", "f16")
    if "bf16" in wanted:
        paths["bf16"] = llama_cpp_side.write_gguf(weights, config, root / "m-bf16.gguf", "bf16")
    for kind in wanted & {"q8_0", "Q4_0"}:
        paths[kind] = llama_cpp_side.quantize(paths["f16"], root / f"m-{kind}.gguf", kind, threads)
    return {kind: llama_cpp_side.LlamaCpp(paths[kind], threads, clock) for kind in sorted(wanted)}


def measure_ours(model: ModelSlice, tiny: ModelSlice, tokens: int, context: int) -> dict[str, float]:
    """context: the prompt before the 8-stream decodes on the contiguous and the paged cache."""
    return {"one": decode_tps(model, 1, tokens), "eight": decode_tps(model, 8, tokens, prompt=context),
            "paged": decode_tps(model, 8, tokens, block=PAGE, prompt=context),
            "prefill": prefill_tps(model), "tiny": decode_tps(tiny, 1, tokens)}


def run_rounds(models: dict[str, ModelSlice], tiny: dict[str, ModelSlice], theirs: dict[str, llama_cpp_side.LlamaCpp],
               args: argparse.Namespace) -> dict[str, list[float]]:
    """Every measurement once per round, formats interleaved, llama.cpp's right after ours of the same width."""
    results: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for name, model in models.items():
            with matmuls_for(name), head_for(name, model, tiny[name]):
                figures = measure_ours(model, tiny[name], args.tokens, args.context)
            their = theirs.get(llama_cpp_side.PAIRS.get(name, ""))
            if their is not None:
                figures |= {"their-one": their.decode_tps(args.tokens), "their-prefill": their.prefill_tps(PREFILL)}
            for key, value in figures.items():
                results.setdefault(f"{name}/{key}", []).append(value)
    return results


def paired(a: list[float], b: list[float]) -> float:
    """The median of each round's a ÷ b: the two were measured back to back in that round, so a slow spell of the
    machine moves both, where a ratio of medians can pair a fast round of one with a slow round of the other."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def report(models: dict[str, ModelSlice], theirs: dict[str, llama_cpp_side.LlamaCpp],
           results: dict[str, list[float]], args: argparse.Namespace) -> None:
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"random Llama {SHAPE}, {args.threads} threads, {args.tokens} decode tokens, {PREFILL}-token prefill, "
          f"medians of {args.rounds} interleaved rounds (tok/s by the {args.clock} clock; ratios: medians of each "
          f"round's ratio)")
    print(f"8 streams at {args.context}-{args.context + args.tokens} positions; pg÷ct: paged (blocks of {PAGE}) ÷ "
          "contiguous")
    print(f"{'ours':11} {'decode':>7} {'8str÷1':>7} {'pg÷ct':>6} {'prefill':>8} {'MB':>6} {'ovh%':>5} | "
          f"{'llama.cpp':9} "
          f"{'decode':>7} {'prefill':>8} {'MB':>6} | {'dec÷':>5} {'pre÷':>5}")
    for name, model in models.items():
        keys = ("one", "eight", "paged", "tiny", "prefill")
        one, eight, paged, tiny, prefill = (results[f"{name}/{k}"] for k in keys)
        line = (f"{name:11} {median[f'{name}/one']:7.1f} {paired(eight, one):7.2f} {paired(paged, eight):6.3f} "
                f"{median[f'{name}/prefill']:8.1f} "
                f"{weight_bytes(model) / 1e6:6.0f} {100 * paired(one, tiny):5.1f} |")
        base = base_format(name)
        kind = llama_cpp_side.PAIRS.get(base, "")
        if f"{base}/their-one" in median:
            their_one, their_prefill = results[f"{base}/their-one"], results[f"{base}/their-prefill"]
            line += (f" {kind:9} {median[f'{base}/their-one']:7.1f} {median[f'{base}/their-prefill']:8.1f} "
                     f"{theirs[kind].nbytes / 1e6:6.0f} | {paired(one, their_one):5.2f} "
                     f"{paired(prefill, their_prefill):5.2f}")
        print(line)
    print("raw:", json.dumps({k: [round(v, 1) for v in vs] for k, vs in results.items()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even when installed")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--context", type=int, default=16, help="prompt positions before the 8-stream decodes")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    formats = args.formats.split(",")
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="skulk-bench-engine-"))
    try:
        config, weights = write_model(root / "m", SHAPE)
        write_model(root / "tiny", TINY)
        models, tiny = load_ours(root, formats)
        theirs: dict[str, llama_cpp_side.LlamaCpp] = {}
        if args.no_llama:
            pass
        elif llama_cpp_side.available():
            theirs = load_llama_cpp(root, config, weights, formats, args.threads)
        else:
            print(f"llama.cpp not installed, its rows are left out; to add them: {llama_cpp_side.INSTALL}")
        del weights
        report(models, theirs, run_rounds(models, tiny, theirs, args), args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
