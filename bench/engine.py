"""The engine's forward path per weight format, side by side in one run, on a random ~500M Llama.

The model is issue 14's reference shape (vocab 32768, hidden 1024, 24 layers, 16/8 heads, ffn 4864), written
once as a float checkpoint and loaded as f32, f16, bf16, and quantized at load to int8 and int4 (weight-only
kernels, bf16 activations). For each format, interleaved over --rounds so noise hits all alike (medians):
  decode tok/s of one greedy stream (a batched forward of one row with the KV cache, as the engine steps)
  decode tok/s of 8 streams together ÷ one stream                                    (target >= 3)
  prefill tok/s of a 512-token prompt
  weight bytes in memory
llama.cpp's figures for the same shapes are in issue 14; to put them side by side here, install
`pip install llama-cpp-python` and convert this checkpoint with llama.cpp's convert_hf_to_gguf.py (not a
dependency of this project).

Run: .venv/bin/python bench/engine.py [--rounds 3] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.config import ModelArgs
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice

SHAPE = {"vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
         "num_key_value_heads": 8, "intermediate_size": 4864}
FORMATS = {"f32": {"dtype": "float32"}, "f16": {"dtype": "float16"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}


def write_model(path: Path) -> Path:
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", **SHAPE}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    model = ModelSlice(ModelArgs.from_config(config))
    generator = torch.Generator().manual_seed(0)
    weights = {f"model.{n}" if not n.startswith("lm_head") else n:
               (torch.randn(t.shape, generator=generator) * 0.02).to(torch.bfloat16)
               for n, t in model.state_dict().items()}
    for name in weights:
        if "norm" in name:
            weights[name] = torch.ones_like(weights[name])
    save_file(weights, str(path / "model.safetensors"))
    return path


def decode_tps(model: ModelSlice, streams: int, tokens: int) -> float:
    cache = model.make_cache(streams, 256)
    prompt = 16
    with torch.inference_mode():
        ids = torch.randint(0, SHAPE["vocab_size"], (streams, prompt))
        model(ids, StepBatch.build(torch.arange(prompt).repeat(streams, 1), 0), cache, last_only=True)
        next_ids = torch.zeros(streams, 1, dtype=torch.long)
        start = time.perf_counter()
        for step in range(tokens):
            positions = torch.full((streams, 1), prompt + step)
            logits = model(next_ids, StepBatch.build(positions, 0, kv_len=prompt + step + 1), cache)
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
    return streams * tokens / (time.perf_counter() - start)


def prefill_tps(model: ModelSlice, length: int = 512) -> float:
    cache = model.make_cache(1, length)
    with torch.inference_mode():
        ids = torch.randint(0, SHAPE["vocab_size"], (1, length))
        start = time.perf_counter()
        model(ids, StepBatch.build(torch.arange(length).unsqueeze(0), 0, kv_len=length), cache, last_only=True)
    return length / (time.perf_counter() - start)


def weight_bytes(model: ModelSlice) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="skulk-bench-engine-"))
    try:
        path = write_model(root / "m")
        models = {name: load_model(path, **options) for name, options in FORMATS.items()}  # type: ignore[arg-type]
        results: dict[str, dict[str, list[float]]] = {n: {"one": [], "eight": [], "prefill": []} for n in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                results[name]["one"].append(decode_tps(model, 1, args.tokens))
                results[name]["eight"].append(decode_tps(model, 8, args.tokens))
                results[name]["prefill"].append(prefill_tps(model))
        print(f"random Llama {SHAPE}, {args.threads} threads, medians of {args.rounds}")
        print(f"{'weights':8} {'decode tok/s':>13} {'8 streams x':>12} {'prefill tok/s':>14} {'weight MB':>10}")
        for name, model in models.items():
            one, eight, prefill = (statistics.median(results[name][k]) for k in ("one", "eight", "prefill"))
            print(f"{name:8} {one:13.1f} {eight / one:12.2f} {prefill:14.1f} {weight_bytes(model) / 1e6:10.0f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
