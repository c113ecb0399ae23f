"""Each family we run, as llama.cpp writes it to GGUF, loads natively and computes what its safetensors twin does.

A scaled-down random checkpoint of each family's real config (test_model_families) is written to GGUF the way
llama.cpp's converter does (llama.cpp's tensor names, q/k rows permuted for Llama and Mistral, Gemma's norms
plus one, Qwen3-MoE's experts stacked, the projections in Q8_0 and norms in F32, a byte-level gpt2 vocabulary
with a chat template), imported (config and tokenizer from the file's metadata), and compared logit for logit
with the float checkpoint: only Q8_0's rounding and the kernels' int8 activations separate them, where a wrong
name, permutation or norm would not be close at all."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.loader import load_model
from skulk.models.demo import CHATML_TEMPLATE, SPECIAL_TOKENS, _bytes_to_unicode
from skulk.models.gguf_import import import_gguf

from .test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # runs real model compute: `make test`, not `make test-fast`

FAMILIES = {  # model id -> llama.cpp's architecture name
    "meta-llama/Llama-3.2-1B-Instruct": "llama", "mistralai/Mistral-7B-Instruct-v0.3": "llama",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2", "Qwen/Qwen3-0.6B": "qwen3", "google/gemma-3-1b-it": "gemma3",
    "Qwen/Qwen3-30B-A3B": "qwen3moe",
}
_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "post_attention_layernorm": "ffn_norm",
}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}



def write_vocab(writer: GGUFWriter, size: int) -> None:
    """A byte-level gpt2 vocabulary of `size` tokens (the demo model's specials, one merge) with the ChatML
    template, as llama.cpp's converter writes a tokenizer's metadata."""
    vocab = [c for _, c in sorted(_bytes_to_unicode().items())] + list(SPECIAL_TOKENS) + ["ĠĠ"]
    vocab += [f"<pad{i}>" for i in range(size - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * 256 + [3] * len(SPECIAL_TOKENS) + [1] * (len(vocab) - 256 - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_chat_template(CHATML_TEMPLATE)

def gguf_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    base, _, part = rest.rpartition(".")
    table = {**_GGUF_NAMES, **(_GEMMA_NAMES if arch == "gemma3" else {})}
    return f"blk.{layer}.{table[base]}.{part}"


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute of a Llama q/k projection's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, a MoE's experts stacked per projection [experts, out, in] as GGUF keeps them."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        head, _, tail = name.partition(".mlp.experts.")
        index, _, projection = tail.partition(".")
        experts.setdefault(f"{head}.mlp.experts.{projection}", {})[int(index)] = tensors.pop(name)
    for name, parts in experts.items():
        tensors[name] = torch.stack([parts[i] for i in sorted(parts)])
    return tensors


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): Llama 3 rope scaling as one divisor per rotary
    pair, written as the tensor rope_freqs.weight; the file's metadata says nothing else about the scaling."""
    rope = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(config: dict[str, Any], hf_dir: Path, arch: str, out: Path, *, quantized: bool = True) -> Path:
    """The checkpoint as llama.cpp's converter writes it; projections in Q8_0 (quantized) or F32."""
    writer = GGUFWriter(str(out), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window") and arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "qwen3moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    write_vocab(writer, config["vocab_size"])
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for name, tensor in hf_tensors(hf_dir).items():
        if name.endswith("norm.weight") and arch == "gemma3":
            tensor = tensor + 1
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            tensor = permute(tensor, heads if ".q_proj." in name else kv_heads)
        name = name.replace(".mlp.experts.", ".mlp.").replace(".mlp.gate_proj.weight", ".mlp.gate_proj.weight")
        target = gguf_name(name, arch)
        if ".mlp." in name and tensor.dim() == 3:
            target = target.replace("ffn_gate.", "ffn_gate_exps.").replace("ffn_up.", "ffn_up_exps.").replace(
                "ffn_down.", "ffn_down_exps.")
        data = tensor.numpy().astype(np.float32)
        if quantized and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "ffn_gate_inp" not in target:
            writer.add_tensor(target, quantize(data, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("model_id", sorted(FAMILIES))
def test_each_family_from_gguf_computes_what_its_checkpoint_does(model_id: str, tmp_path: Path) -> None:
    arch = FAMILIES[model_id]
    config = scaled_down(model_id, {**REAL_CONFIGS[model_id], "rope_scaling": None}, vocab=320)
    hf_dir = write_checkpoint(config, tmp_path / "hf")
    card = import_gguf(write_gguf(config, hf_dir, arch, tmp_path / "model.gguf"), tmp_path / "models", "t/gguf")
    gguf_dir = tmp_path / "models" / "t--gguf"
    imported = json.loads((gguf_dir / "config.json").read_text())
    assert card.n_layers == config["num_hidden_layers"] and imported["quantization"]["bits"] == 8
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 4])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    outputs = []
    for path in (hf_dir, gguf_dir):
        model = load_model(path, dtype=torch.float32)
        with torch.inference_mode():
            outputs.append(model(ids, StepBatch.build(positions, 0), model.make_cache(1, 64))[0].float())
    expected, got = outputs
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 0.05, error
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


LLAMA3_LONG = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
"""Llama 3 rope scaling with an original context of 64 (the real one is 8,192), so that 160 positions reach
far enough along the scaled, slow frequencies for a wrong rope to show in the logits."""


def test_llama3_rope_freqs_from_gguf_match_the_hugging_face_checkpoint(tmp_path: Path) -> None:
    """A Llama 3.2 checkpoint with rope scaling, converted as llama.cpp does (rope_freqs.weight holds the scaling),
    imported and run: its logits over 160 positions are transformers' on the safetensors, and the same file
    without its factors is not (the test can fail). F32 weights, so nothing but the rope separates them."""
    model_id = "meta-llama/Llama-3.2-1B-Instruct"
    config = scaled_down(model_id, {**REAL_CONFIGS[model_id], "rope_scaling": LLAMA3_LONG}, vocab=320)
    hf_dir = write_checkpoint(config, tmp_path / "hf")
    gguf = write_gguf(config, hf_dir, "llama", tmp_path / "model.gguf", quantized=False)
    import_gguf(gguf, tmp_path / "models", "t/llama3")
    gguf_dir = tmp_path / "models" / "t--llama3"
    imported = json.loads((gguf_dir / "config.json").read_text())
    np.testing.assert_allclose(imported["rope_freq_factors"], llama3_rope_factors(config))
    assert 1.0 in imported["rope_freq_factors"] and 8.0 in imported["rope_freq_factors"]

    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3, 250, 17, 64, 8, 90, 31] * 10])
    reference = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids).logits[0]
    got = _logits(gguf_dir, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    (gguf_dir / "config.json").write_text(json.dumps({k: v for k, v in imported.items() if k != "rope_freq_factors"}))
    unscaled = _logits(gguf_dir, ids)
    late = slice(64, None)  # past the original context, where the scaled frequencies have turned far enough
    wrong = ((unscaled[late] - expected[late]).norm() / expected[late].norm()).item()
    right = ((got[late] - expected[late]).norm() / expected[late].norm()).item()
    assert wrong > 100 * right, (wrong, right)


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(model_dir, dtype=torch.float32)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        return model(ids, StepBatch.build(positions, 0), model.make_cache(1, 192))[0].float()
