"""An MLX rank serves a GGUF import: the bf16 export (models/gguf_export.py) holds what the `gguf` package
dequantizes, with llama.cpp's q/k permutation undone, and the MLX engine on the imported directory generates the
torch engine's greedy tokens (the torch engine reading the same file's blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from skulk.engines.torch.gguf_file import unpermute_order
from skulk.models.gguf_export import EXPORT_DIR, NotExportable, float_checkpoint
from skulk.models.gguf_import import GGUF_BACKENDS, TORCH_BACKENDS, bf16_export_bytes, import_gguf

from .test_gguf_families import LLAMA3_LONG, hf_tensors, write_gguf
from .test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LLAMA = "meta-llama/Llama-3.2-1B-Instruct"


def _import(tmp_path: Path, *, quantized: bool, rope_scaling: dict[str, object] | None = None) -> tuple[Path, Path]:
    """(the float checkpoint, its GGUF import's directory): a scaled-down Llama written as llama.cpp does."""
    config = scaled_down(LLAMA, {**REAL_CONFIGS[LLAMA], "rope_scaling": rope_scaling}, vocab=320)
    hf_dir = _louder(write_checkpoint(config, tmp_path / "hf"))
    gguf = write_gguf(config, hf_dir, "llama", tmp_path / "model.gguf", quantized=quantized)
    card = import_gguf(gguf, tmp_path / "models", "t/gguf")
    assert card.compatible_backends == (TORCH_BACKENDS if rope_scaling else GGUF_BACKENDS)
    return hf_dir, tmp_path / "models" / "t--gguf"


def _louder(hf_dir: Path) -> Path:
    """Projections scaled up so that attention (and so the rope and the q/k row order) drives the next token:
    at their initial scale the residual stream carries the embedding through and greedy decoding repeats the
    last prompt token, which no wrong permutation would change."""
    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, values in tensors.items():
        if values.dim() == 2 and "embed" not in name:
            tensors[name] = values * 6
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hf_dir


def test_the_export_is_the_gguf_dequantization_in_hugging_face_order(tmp_path: Path) -> None:
    """Q8_0 projections: each exported tensor is bf16(gguf.quants.dequantize(block)), q/k rows unpermuted, so it
    lies within Q8_0's rounding of the original checkpoint (a wrong permutation or name would be far off)."""
    hf_dir, imported = _import(tmp_path, quantized=True)
    export = float_checkpoint(imported)
    assert export == imported / EXPORT_DIR and float_checkpoint(export) == export  # written once, then reused
    got = load_file(str(export / "model.safetensors"))
    config = json.loads((export / "config.json").read_text())
    assert "quantization" not in config and "gguf" not in config and config["torch_dtype"] == "bfloat16"
    original = hf_tensors(hf_dir)
    assert set(got) == set(original) - {"lm_head.weight"} or set(got) == set(original)
    for name, values in got.items():
        assert values.dtype == torch.bfloat16
        error = ((values.float() - original[name]).norm() / original[name].norm()).item()
        assert error < 0.01, (name, error)
    assert bf16_export_bytes(imported / "model.gguf") == sum(2 * v.numel() for v in got.values())  # placement's
    reader = {t.name: t for t in GGUFReader(imported / "model.gguf").tensors}
    q = reader["blk.0.attn_q.weight"]
    reference = torch.from_numpy(dequantize(q.data, q.tensor_type).copy())
    reference = reference[unpermute_order(reference.shape[0], config["num_attention_heads"])]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], reference.to(torch.bfloat16))
    assert not torch.equal(reference, torch.from_numpy(dequantize(q.data, q.tensor_type).copy()))  # it was permuted


def test_llama3_rope_scaling_stays_on_torch(tmp_path: Path) -> None:
    """The export cannot carry rope_freqs to mlx-lm: the card is torch-only and the export says why."""
    _, imported = _import(tmp_path, quantized=False, rope_scaling=LLAMA3_LONG)
    with pytest.raises(NotExportable, match="torch engine"):
        float_checkpoint(imported)


TOKENS = 24


def test_the_mlx_engine_serves_a_gguf_import_with_the_torch_engines_tokens(tmp_path: Path) -> None:
    """The same imported directory on both engines (torch reads the file's blocks, MLX its bf16 export), greedy:
    the same tokens for 24 tokens, or the first divergence is a bf16 tie (the two candidates' logits within
    bf16's resolution at their magnitude)."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    from skulk.engines.mlx.engine import MlxEngine, load
    from skulk.engines.torch.engine import TorchEngine
    from skulk.types.chat import SamplingParams

    from .test_mlx_engine import PROMPTS, run, tokens

    _, imported = _import(tmp_path, quantized=False)
    config = json.loads((imported / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)  # random weights would end some requests early
    (imported / "tokenizer_config.json").write_text(json.dumps(config))
    (imported / "generation_config.json").unlink()
    model_config = json.loads((imported / "config.json").read_text())
    model_config.pop("eos_token_id", None)
    (imported / "config.json").write_text(json.dumps(model_config))
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0)
    got = tokens(run(MlxEngine(imported, prefill_chunk=8, max_seq=256), PROMPTS, greedy))
    expected = tokens(run(TorchEngine(imported, prefill_chunk=8, max_seq=256), PROMPTS, greedy))
    assert set(got) == set(expected) == {"r0", "r1", "r2"}
    model, _ = load(imported)
    for rid, theirs in expected.items():
        mine = got[rid]
        assert len(mine) == len(theirs) == TOKENS, rid
        if mine != theirs:
            at = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            logits = model(mx.array([PROMPTS[int(rid[1:])] + theirs[:at]]))[0, -1].astype(mx.float32)
            gap = abs(float(logits[mine[at]]) - float(logits[theirs[at]]))
            resolution = 2 ** (np.floor(np.log2(abs(float(logits[theirs[at]])) + 1e-9)) - 7)
            assert gap <= 2 * resolution, f"{rid} diverges at {at} with gap {gap} (bf16 step {resolution})"
