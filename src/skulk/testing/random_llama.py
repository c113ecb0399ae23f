"""Seeded random Llama checkpoints of a real model's shape, for parity tests and benchmarks that need size, not
sense: the CUDA parity test and bench/cuda_bench.py (issue 45) use Llama 3.2 1B's body.

The weights are drawn on the GPU when there is one (a billion normal samples take seconds there, a minute on one
CPU core), then written as bf16 safetensors with the demo model's byte tokenizer (no end-of-sequence token, so
every request runs its whole length). `std` sets how peaked greedy's choices are: 0.02 (a trained model's scale)
gives near-uniform logits whose top two tie often; the parity tests use more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models import read_args

LLAMA_1B = {"vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 8192, "head_dim": 64}
"""Llama 3.2 1B's shape (its embedding untied here, as the lm_head of a bigger one is)."""


def write_random_llama(path: Path, shape: dict[str, int], tokenizer_from: Path, *, std: float = 0.02,
                       seed: int = 0) -> Path:
    """A random bf16 Llama checkpoint of `shape` at path (created), with tokenizer_from's tokenizer files."""
    config: dict[str, Any] = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **shape}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, meta in ModelSlice(read_args(config)).state_dict().items():
        key = name if name.startswith("lm_head") else f"model.{name}"
        if "norm" in name:
            weights[key] = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            drawn = torch.randn(meta.shape, generator=generator, device=device) * std
            weights[key] = drawn.to(torch.bfloat16).cpu()
    save_file(weights, str(path / "model.safetensors"))
    shutil.copy(tokenizer_from / "tokenizer.json", path / "tokenizer.json")
    tokenizer = json.loads((tokenizer_from / "tokenizer_config.json").read_text())
    tokenizer.pop("eos_token", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return path
