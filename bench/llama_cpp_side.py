"""llama.cpp's side of bench/engine.py: the same random checkpoint as GGUF, and its decode/prefill tok/s.

Not a dependency of the project; install both into the venv to get llama.cpp's rows:
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python gguf
(llama-cpp-python builds llama.cpp from source for this CPU: ~20 min on 2 cores). The checkpoint is written by
`gguf`'s pure-python writer the way llama.cpp's convert_hf_to_gguf.py writes a Llama (q/k rows permuted to its
rope layout, norms in f32, a placeholder SentencePiece vocabulary: the bench feeds token ids, never text), as
f16 and bf16; q8_0 and Q4_0 are made from the f16 file by llama.cpp's own `llama_model_quantize`, with its
defaults for the format (Q4_0 keeps output.weight at Q6_K, as llama-quantize does).
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

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install llama-cpp-python gguf'
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


def quantize(source: Path, target: Path, kind: str, threads: int) -> Path:
    """llama.cpp's llama_model_quantize: source GGUF -> target in "q8_0" or "Q4_0"."""
    import llama_cpp  # pyright: ignore[reportMissingImports]

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.nthread = threads
    with _quiet():
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed ({status})")
    return target


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
