"""GGUF files of the families whose GGUF layout the torch engine does not read (llama.cpp's `deepseek2`, `glm4moe`,
`gpt-oss`, `qwen3next`, `qwen35moe`, `qwen35`) import as a Hugging Face checkpoint that the torch engine (natively:
models/deepseek_v3.py, glm4_moe.py, qwen3_5.py ...), its transformers fallback and mlx-lm run (models/gguf_moe.py).

Each family's seeded random checkpoint (family_checkpoints.py) is written to GGUF the way llama.cpp's
convert_hf_to_gguf does: its metadata keys, gguf-py's own tensor name map, experts stacked per projection,
DeepSeek's kv_b_proj split into attn_k_b (transposed) and attn_v_b as newer converters write it (or whole, as
older ones did), GLM's multi-token-prediction layer counted in block_count, Qwen3.5's value heads reordered
(_reorder_v_heads) with more value heads than key heads. Imported, the directory's logits under transformers are
the float checkpoint's: exactly for an F32 file, within Q8_0's rounding for a quantized one, where a wrong name,
split or transpose would not be close at all."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from skulk.engines.torch.models import SUPPORTED_MODEL_TYPES
from skulk.models.gguf_import import NotGGUF, import_gguf
from skulk.models.memory_math import model_memory
from tests.unit.test_gguf_families import write_vocab

from .family_checkpoints import write_model
from .test_gguf_families import hf_tensors

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VOCAB = 264
ARCHS = {"deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2, "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE,
         "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
         "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE, "qwen3_5": gguf.MODEL_ARCH.QWEN35}
QWEN3_5 = ("qwen3_5_moe", "qwen3_5")
"""Published as Qwen3_5(Moe)ForConditionalGeneration: text_config, tensors under model.language_model."""
IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3, 250, 17, 64, 8, 90, 31] * 2])


def _metadata(writer: GGUFWriter, config: dict[str, Any], family: str, split_kv: bool, softmax: bool = False) -> None:
    """The keys convert_hf_to_gguf writes for the family (TextModel's, then DeepseekV2Model's, Glm4MoeModel's or
    GptOssModel's)."""
    nextn = 1 if family == "glm4_moe" else 0  # GLM counts its MTP layer; DeepSeek's converter skips it
    writer.add_block_count(config["num_hidden_layers"] + nextn)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if "intermediate_size" in config:  # TextModel writes it only where the config has one (not Qwen3.5 MoE's)
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "num_experts_per_tok" in config:
        writer.add_expert_used_count(config["num_experts_per_tok"])
    rope_parameters = config["rope_parameters"]
    if rope_parameters.get("rope_type") == "yarn":  # TextModel's rope scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
    if family in ("qwen3_next", *QWEN3_5):  # Qwen2MoeModel's keys, then Qwen3NextModel's (Qwen3.5: M-RoPE too)
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        if family != "qwen3_5":  # the dense Qwen3.5 has no experts
            writer.add_expert_count(config["num_experts"])
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if family in QWEN3_5:
            writer.add_rope_dimension_sections([*rope_parameters.get("mrope_section", [11, 11, 10]), 0])
        writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(config["linear_key_head_dim"])
        writer.add_ssm_group_count(config["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
        writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        # the published configs' full_attention_interval (transformers saves only the layer_types it made of it)
        interval = config.get("full_attention_interval") or config["layer_types"].index("full_attention") + 1
        writer.add_full_attention_interval(interval)
        writer.add_rope_dimension_count(int(config["head_dim"] * rope_parameters["partial_rotary_factor"]))
        return
    if family == "gpt_oss":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
        return
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if softmax else gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    if "mscale_all_dim" in rope_parameters:  # DeepseekV2Model's log multiplier
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])
    if family == "glm4_moe":
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_rope_dimension_count(int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"]))
        writer.add_nextn_predict_layers(nextn)
        return
    rope, nope, kv_lora = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["kv_lora_rank"]
    writer.add_vocab_size(config["vocab_size"])
    writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    writer.add_rope_dimension_count(rope)
    if split_kv:  # MLA as one shared head (newer converters), the per-head widths under *_mla
        writer.add_head_count_kv(1)
        writer.add_key_length(kv_lora + rope)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_head_count_kv(config["num_attention_heads"])
        writer.add_key_length(nope + rope)
        writer.add_value_length(config["v_head_dim"])


def _llama_cpp_tensors(hf_dir: Path, config: dict[str, Any], split_kv: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as convert_hf_to_gguf renames and reshapes them (gguf-py's name map)."""
    family = config["model_type"]
    names = gguf.get_tensor_name_map(ARCHS[family], config["num_hidden_layers"] + 1)
    out: dict[str, torch.Tensor] = {}
    stacked = family == "gpt_oss"  # the hub keeps gpt-oss's experts stacked already
    source = load_file(str(hf_dir / "model.safetensors")) if stacked else hf_tensors(hf_dir)
    for name, tensor in source.items():
        if stacked:
            out.update(_gpt_oss_split(name, tensor, names))
            continue
        if family == "qwen3_next":
            out.update(_qwen3next_converted(name, tensor, names, config))
            continue
        if family in QWEN3_5:
            out.update(_qwen3_5_converted(name, tensor, names, config))
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split_kv and name.endswith("kv_b_proj.weight"):
            nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
            kv_b = tensor.reshape(config["num_attention_heads"], nope + v, tensor.shape[-1])
            k_b, v_b = kv_b.split([nope, v], dim=1)
            k_name = names.get_name(name.replace("kv_b", "k_b"), try_suffixes=(".weight",))
            v_name = names.get_name(name.replace("kv_b", "v_b"), try_suffixes=(".weight",))
            assert k_name is not None and v_name is not None, name
            out[k_name], out[v_name] = k_b.transpose(1, 2), v_b
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        out[target] = tensor
    return out


def _gpt_oss_split(name: str, tensor: torch.Tensor, names: Any) -> dict[str, torch.Tensor]:
    """GptOssModel.modify_tensors on an unquantized checkpoint: sinks get `.weight`, down_proj is transposed,
    gate_up_proj transposed and split into its interleaved gate (even) and up (odd) rows."""
    def named(hf: str) -> str:
        target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert target is not None, hf
        return target

    if name.endswith("sinks"):
        return {named(name + ".weight"): tensor}
    if name.endswith("down_proj"):
        return {named(name + ".weight"): tensor.transpose(-1, -2)}
    if name.endswith("down_proj_bias"):
        return {named(name.replace("down_proj_bias", "down_proj.bias")): tensor}
    if name.endswith("gate_up_proj"):
        rows = tensor.transpose(-1, -2)
        return {named(name.replace("gate_up_proj", "gate_proj.weight")): rows[:, ::2],
                named(name.replace("gate_up_proj", "up_proj.weight")): rows[:, 1::2]}
    if name.endswith("gate_up_proj_bias"):
        return {named(name.replace("gate_up_proj_bias", "gate_proj.bias")): tensor[..., ::2],
                named(name.replace("gate_up_proj_bias", "up_proj.bias")): tensor[..., 1::2]}
    return {named(name): tensor}


def _qwen3next_converted(name: str, tensor: torch.Tensor, names: Any, config: dict[str, Any]
                         ) -> dict[str, torch.Tensor]:
    """Qwen3NextModel.modify_tensors: A_log as -exp(A_log), dt_bias renamed, the conv kernel squeezed, every norm
    but the linear attention's plus one, and in_proj_qkvz split into attn_qkv (all q, all k, all v rows) and
    attn_gate (z) from its per-key-head [q, k, v, z] groups."""
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    if "in_proj_qkvz.weight" in name:
        key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
        heads = config["linear_num_key_heads"]
        per_key = config["linear_num_value_heads"] // heads
        grouped = tensor.reshape(heads, 2 * key_dim + 2 * per_key * value_dim, tensor.shape[-1])
        q, k, v, z = grouped.split([key_dim, key_dim, per_key * value_dim, per_key * value_dim], dim=1)
        layer = name.split(".")[2]
        return {f"blk.{layer}.attn_qkv.weight": torch.cat([t.reshape(-1, tensor.shape[-1]) for t in (q, k, v)]),
                f"blk.{layer}.attn_gate.weight": z.reshape(-1, tensor.shape[-1])}
    target = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert target is not None, name
    return {target: tensor}


def reorder_v_heads(tensor: torch.Tensor, dim: int, config: dict[str, Any], width: int) -> torch.Tensor:
    """llama.cpp's _reorder_v_heads: value heads grouped by key head (k0v0, k0v1, .., k1v0, ..) to tiled order
    (k0v0, k1v0, .., k0v1, ..): the axis as [key heads, value heads per key head, width], its first two swapped."""
    keys = config["linear_num_key_heads"]
    per_key = config["linear_num_value_heads"] // keys
    shape = tensor.shape
    grouped = tensor.reshape(*shape[:dim], keys, per_key, width, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen3_5_converted(name: str, tensor: torch.Tensor, names: Any, config: dict[str, Any]
                       ) -> dict[str, torch.Tensor]:
    """_LinearAttentionVReorderBase.modify_tensors (Qwen3_5TextModel, Qwen3_5MoeTextModel): the language model's
    tensors only (model.language_model. read as model.), Qwen3NextModel's A_log, dt_bias, conv and norm rules,
    and every value-head tensor reordered to llama.cpp's tiled order: in_proj_qkv's v rows and the conv's v
    channels, in_proj_z's rows, in_proj_a/b's, A_log's and dt_bias's, out_proj's columns."""
    if not name.startswith(("model.language_model.", "lm_head.")):
        return {}  # the vision tower (Qwen3_5MoeForConditionalGeneration's model.visual.)
    name = name.replace("model.language_model.", "model.")
    value_rows = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    width = config["linear_value_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        tensor = tensor.squeeze(1) if "conv1d" in name else tensor
        qk, v = tensor.split([tensor.shape[0] - value_rows, value_rows])
        tensor = torch.cat([qk, reorder_v_heads(v, 0, config, width)])
    elif name.endswith("in_proj_z.weight"):
        tensor = reorder_v_heads(tensor, 0, config, width)
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
        tensor = reorder_v_heads(tensor, 0, config, 1)
    elif name.endswith("out_proj.weight"):
        tensor = reorder_v_heads(tensor, 1, config, width)
    if name.endswith(".A_log"):
        tensor = -torch.exp(tensor)
    elif name.endswith(".dt_bias"):
        name = name.replace(".dt_bias", ".dt_proj.bias")
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    target = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert target is not None, name
    return {target: tensor}


def text_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (Qwen3.5's text_config), else the config itself."""
    return {**config["text_config"], "model_type": config["model_type"]} if "text_config" in config else config


def write_llama_cpp_gguf(hf_dir: Path, out: Path, *, quantized: bool, split_kv: bool = True,
                         experts: QT = QT.Q8_0, softmax: bool = False, fused_experts: bool = False) -> Path:
    """The family checkpoint in hf_dir as llama.cpp's converter writes it: 2-D and 3-D projections in Q8_0 (the
    stacked experts' weights in `experts`) where their rows are whole blocks (quantized), the rest in F32. GLM's
    file gets its MTP layer's tensors too; fused_experts writes each layer's gate and up experts as one
    ffn_gate_up_exps."""
    config = text_of(json.loads((hf_dir / "config.json").read_text()))
    family = config["model_type"]
    writer = GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[ARCHS[family]])
    _metadata(writer, config, family, split_kv, softmax)
    write_vocab(writer, VOCAB)
    tensors = _llama_cpp_tensors(hf_dir, config, split_kv)
    if family == "glm4_moe":  # the MTP layer, which the import drops
        mtp = config["num_hidden_layers"]
        tensors[f"blk.{mtp}.attn_norm.weight"] = torch.ones(config["hidden_size"])
        tensors[f"blk.{mtp}.nextn.eh_proj.weight"] = torch.ones(config["hidden_size"], 2 * config["hidden_size"])
    if fused_experts:  # llama.cpp's ffn_gate_up_exps: each expert's gate rows, then its up rows
        for name in [n for n in tensors if n.endswith("ffn_gate_exps.weight")]:
            up = tensors.pop(name.replace("ffn_gate_exps", "ffn_up_exps"))
            tensors[name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = torch.cat([tensors.pop(name), up], dim=1)
    for name, tensor in tensors.items():
        data = tensor.contiguous().numpy().astype(np.float32)
        if quantized and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:  # _quantized
            kind = experts if name.endswith("_exps.weight") else QT.Q8_0
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _logits(model_dir: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[0].float()


def _qwen3_5_model(family: str, root: Path) -> Path:
    """Qwen3.5's seeded random checkpoint as test_qwen3_5 draws it (4 value heads over 2 key heads, so llama.cpp's
    reorder moves rows), with this file's vocabulary."""
    import transformers

    from .test_qwen3_5 import MOE, TEXT, VISION, draw

    torch.manual_seed(1)
    text = TEXT | {"vocab_size": VOCAB} | (MOE if family == "qwen3_5_moe" else {"intermediate_size": 96})
    kind = "Qwen3_5Moe" if family == "qwen3_5_moe" else "Qwen3_5"
    config = getattr(transformers, f"{kind}Config")(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    model = draw(getattr(transformers, f"{kind}ForConditionalGeneration")(config).float().eval())
    model.save_pretrained(root / family)
    return root / family


def _import(family: str, tmp_path: Path, *, quantized: bool, split_kv: bool = True, experts: QT = QT.Q8_0,
            fused_experts: bool = False, **overrides: Any) -> tuple[Path, Path, Any]:
    if family in QWEN3_5:
        hf_dir = _qwen3_5_model(family, tmp_path / "hf")
    else:
        hf_dir = write_model(family, tmp_path / "hf", vocab_size=VOCAB, **overrides)
    gguf_file = write_llama_cpp_gguf(hf_dir, tmp_path / "model.gguf", quantized=quantized, split_kv=split_kv,
                                     experts=experts, fused_experts=fused_experts)
    card = import_gguf(gguf_file, tmp_path / "models", f"t/{family}")
    return hf_dir, tmp_path / "models" / f"t--{family}", card


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_an_f32_file_imports_as_its_checkpoint_exactly(family: str, tmp_path: Path) -> None:
    """F32 tensors: the imported checkpoint is the original's, so transformers computes the same logits."""
    hf_dir, imported, card = _import(family, tmp_path, quantized=False)
    runtime = "native" if family in SUPPORTED_MODEL_TYPES else "transformers"  # DeepSeek V3, GLM-4 MoE, gpt-oss: native
    assert card.family == family and card.torch_runtime == runtime and card.mlx_storage_size is None
    assert card.compatible_backends is None or "torch" in card.compatible_backends
    written = sum(p.stat().st_size for p in imported.glob("*.safetensors"))
    assert card.storage_size.in_bytes == written  # the card counts the checkpoint the engines load
    assert not (imported / "model.gguf").exists()
    config = json.loads((imported / "config.json").read_text())
    assert text_of(config)["num_hidden_layers"] == text_of(json.loads((hf_dir / "config.json").read_text())
                                                           )["num_hidden_layers"]
    assert config["torch_dtype"] == "float32"
    memory = model_memory(config)  # the import writes no multi-token-prediction weights: the config says none
    assert memory is not None and memory.unrun_bytes == 0
    torch.testing.assert_close(_logits(imported), _logits(hf_dir), atol=1e-5, rtol=1e-5)


def _rounded(hf_dir: Path, out: Path, experts: QT = QT.Q8_0) -> Path:
    """hf_dir with every tensor the file holds in Q8_0 rounded as the import reads it back: Q8_0 blocks
    dequantized by the gguf package, then bfloat16. Rows as the file has them: gpt-oss's stacked experts
    transposed (and kv_b_proj, whose halves are 16 wide, stays F32)."""
    shutil.copytree(hf_dir, out)
    config = text_of(json.loads((hf_dir / "config.json").read_text()))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name, values in tensors.items():
        turned = values.dim() == 3 and ".mlp.experts." in name  # gpt-oss: [experts, in, out] in the hub
        rows = values.transpose(-1, -2) if turned else values
        tiled = None  # Qwen3.5's out_proj: its columns' blocks are those of llama.cpp's tiled value heads
        if config["model_type"] in QWEN3_5 and name.endswith("linear_attn.out_proj.weight"):
            tiled = reorder_v_heads(torch.arange(rows.shape[-1]), 0, config, config["linear_value_head_dim"])
            rows = rows[:, tiled]
        if rows.dim() >= 2 and rows.shape[-1] % 32 == 0 and not name.endswith(("gate.weight", "router.weight")):
            kind = experts if ".mlp.experts." in name and "bias" not in name else QT.Q8_0
            back = torch.from_numpy(dequantize(quantize(rows.float().contiguous().numpy(), kind), kind))
            back = back.to(torch.bfloat16).float()
            back = back[:, tiled.argsort()] if tiled is not None else back
            tensors[name] = (back.transpose(-1, -2) if turned else back).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_a_q8_0_file_imports_as_its_rounded_checkpoint(family: str, tmp_path: Path) -> None:
    """Q8_0 projections, dequantized to bfloat16: the logits are those of the float checkpoint with the same
    rounding applied (so a wrong name, split or transpose shows, where comparing with the unrounded checkpoint
    would blur it into the rounding's own expert flips), and the router's picks stay the float model's."""
    hf_dir, imported, card = _import(family, tmp_path, quantized=True)
    assert json.loads((imported / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert card.storage_size.in_bytes == sum(p.stat().st_size for p in imported.glob("*.safetensors"))
    got = _logits(imported)
    torch.testing.assert_close(got, _logits(_rounded(hf_dir, tmp_path / "rounded")), atol=1e-4, rtol=1e-4)
    expected = _logits(hf_dir)
    assert ((got - expected).norm() / expected.norm()).item() < 0.5  # the same model, give or take its rounding


def test_gpt_oss_mxfp4_experts_import_as_their_rounded_checkpoint(tmp_path: Path) -> None:
    """gpt-oss files hold their experts in MXFP4 (the hub's own format, repacked by the converter): dequantized
    by the gguf package they are the rounded checkpoint's."""
    hf_dir, imported, _ = _import("gpt_oss", tmp_path, quantized=True, experts=QT.MXFP4)
    rounded = _rounded(hf_dir, tmp_path / "rounded", experts=QT.MXFP4)
    torch.testing.assert_close(_logits(imported), _logits(rounded), atol=1e-4, rtol=1e-4)


def test_an_older_deepseek_file_with_kv_b_whole_imports_too(tmp_path: Path) -> None:
    """Before llama.cpp split kv_b_proj (attn_kv_b whole, per-head key and value widths as key/value_length)."""
    hf_dir, imported, _ = _import("deepseek_v3", tmp_path, quantized=False, split_kv=False)
    torch.testing.assert_close(_logits(imported), _logits(hf_dir), atol=1e-5, rtol=1e-5)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
"""DeepSeek V3's YaRN (factor 40 over 4,096 positions, mscale 1) scaled down to 64 original positions (the
checkpoint's 512 over its factor), so that 160 positions reach past them."""


def test_deepseek_yarn_rope_scaling_comes_through(tmp_path: Path) -> None:
    """The file's YaRN keys (factor, original context, 0.1 x mscale_all_dim as log multiplier) become the
    hub's rope_scaling: the logits over 160 positions are the checkpoint's, and without the scaling they are
    not (the test can fail)."""
    hf_dir, imported, _ = _import("deepseek_v3", tmp_path, quantized=False, rope_parameters=YARN)
    ids = torch.cat([IDS] * 5, dim=1)
    config = json.loads((imported / "config.json").read_text())
    assert config["rope_scaling"]["factor"] == 8.0 and config["rope_scaling"]["mscale_all_dim"] == 1.0
    expected = _logits(hf_dir, ids)
    torch.testing.assert_close(_logits(imported, ids), expected, atol=1e-5, rtol=1e-5)
    (imported / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    unscaled = _logits(imported, ids)
    assert ((unscaled - expected).norm() / expected.norm()).item() > 1e-2


def test_qwen3_5_value_heads_come_back_from_llama_cpps_tiled_order(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """4 value heads over 2 key heads, so llama.cpp's _reorder_v_heads moves rows of in_proj_qkv, in_proj_z,
    in_proj_a/b, A_log, dt_bias and the conv, and columns of out_proj; the experts fused as ffn_gate_up_exps.
    Imported, every tensor is the checkpoint's and so are the logits; with the inverse reorder skipped they are
    not (the test can fail)."""
    from skulk.models import gguf_moe

    hf_dir, imported, _ = _import("qwen3_5_moe", tmp_path, quantized=False, fused_experts=True)
    source = load_file(str(hf_dir / "model.safetensors"))
    written = {k: v for f in imported.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for name in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "out_proj.weight", "conv1d.weight"):
        key = f"model.language_model.layers.0.linear_attn.{name}"
        assert torch.equal(written[key], source[key]), key
    experts = written["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(experts[3, 32:], source["model.language_model.layers.0.mlp.experts.3.up_proj.weight"])
    expected = _logits(hf_dir)
    torch.testing.assert_close(_logits(imported), expected, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(gguf_moe, "_grouped_heads", lambda values, *_: values)  # the mutation: no inverse
    import_gguf(tmp_path / "model.gguf", tmp_path / "models", "t/qwen3_5_moe")
    unordered = _logits(imported)
    assert ((unordered - expected).norm() / expected.norm()).item() > 1e-2


def test_a_deepseek_file_with_softmax_routing_is_refused_saying_so(tmp_path: Path) -> None:
    """DeepSeek V2's softmax routing (expert_gating_func 1) is not DeepSeek V3's modeling: refused, not mis-run."""
    hf_dir = write_model("deepseek_v3", tmp_path / "hf", vocab_size=VOCAB)
    gguf_file = write_llama_cpp_gguf(hf_dir, tmp_path / "v2.gguf", quantized=False, softmax=True)
    with pytest.raises(NotGGUF, match="softmax routing"):
        import_gguf(gguf_file, tmp_path / "models", "t/v2")
    assert not [p for p in (tmp_path / "models").iterdir()]  # the staging folder went with the refusal


def test_an_architecture_nobody_runs_is_refused_by_name(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotGGUF, match=r"rwkv7.*it imports .*qwen35moe, qwen35"):  # naming those it does import
        import_gguf(tmp_path / "rwkv.gguf", tmp_path / "models", "t/rwkv")
    assert not (tmp_path / "models").exists()  # refused before anything is staged


def _without_eos(imported: Path) -> Path:
    """No end-of-sequence token: random weights would end some requests early (family_checkpoints.with_tokenizer)."""
    config = json.loads((imported / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (imported / "tokenizer_config.json").write_text(json.dumps(config))
    (imported / "generation_config.json").unlink()
    model_config = json.loads((imported / "config.json").read_text())
    model_config.pop("eos_token_id", None)
    (imported / "config.json").write_text(json.dumps(model_config))
    return imported


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_the_engines_serve_the_import_with_transformers_tokens(family: str, tmp_path: Path) -> None:
    """The imported directory as a runner gets it: the torch engine's transformers fallback (and its native layers
    for a family it runs natively), and an MLX rank
    (mlx-lm's own model of the family) where MLX is installed, each give transformers' greedy tokens for the
    float checkpoint (a first divergence only where its top two tie)."""
    from skulk.engines.torch.fallback import FallbackEngine

    from .family_checkpoints import disagreement, reference
    from .test_fallback_families import run

    hf_dir, imported, card = _import(family, tmp_path, quantized=False)
    expected = reference(hf_dir)
    _without_eos(imported)
    assert disagreement(run(FallbackEngine(imported, max_seq=256)), expected) is None
    if family in SUPPORTED_MODEL_TYPES:  # and the torch engine's own layers, which the card offers
        from .test_glm4_moe import _engine_tokens

        assert disagreement(_engine_tokens(imported), expected) is None
    if family == "gpt_oss":  # mlx-lm reads the hub's MXFP4 experts, not transformers' float layout
        assert card.compatible_backends is not None and {t[:5] for t in card.compatible_backends} == {"torch"}
        return
    if importlib.util.find_spec("mlx_lm") is None:
        return
    from skulk.engines.mlx.engine import MlxEngine
    from skulk.types.chat import SamplingParams

    from .family_checkpoints import PROMPTS, TOKENS

    assert card.compatible_backends is None or "mlx" in card.compatible_backends
    engine = MlxEngine(imported, prefill_chunk=8, max_seq=256)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=TOKENS, temperature=0))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got.setdefault(out.request_id, []).append(out.token_id)
    assert disagreement(got, expected) is None


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.MXFP4], ids=lambda q: q.name)
def test_each_tensor_reads_as_the_gguf_package_dequantizes_it(qtype: QT, tmp_path: Path) -> None:
    """Float types keep their dtype and values (whole, or one expert of a stacked tensor); quantized ones are the
    gguf package's dequantization in bfloat16."""
    from gguf import GGUFReader

    from skulk.models.gguf_moe import _values

    data = np.random.default_rng(0).standard_normal((3, 4, 256)).astype(np.float32)
    writer = GGUFWriter(str(tmp_path / "t.gguf"), "x")
    stored = data.astype(np.float16) if qtype == QT.F16 else quantize(data, qtype)
    writer.add_tensor("t", stored, raw_dtype=None if qtype == QT.F16 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFReader(tmp_path / "t.gguf").tensors[0]
    expected = torch.from_numpy(dequantize(tensor.data, qtype).astype(np.float32))
    want = {QT.F16: torch.float16}.get(qtype, torch.bfloat16)
    for got, reference in ((_values(tensor.data, qtype), expected), (_values(tensor.data[1], qtype), expected[1])):
        assert got.dtype == want and got.shape == reference.shape
        assert torch.equal(got, reference.to(want))
