"""A seeded random Qwen2.5-VL checkpoint in the published layout (Qwen/Qwen2.5-VL-3B-Instruct's: a flat config.json
with vision_config and rope_scaling {"type": "mrope"}, tensors named model.layers.* / visual.* / lm_head.*,
preprocessor_config.json with min_pixels and max_pixels, the published chat template), with a byte tokenizer that
has Qwen's special tokens; and transformers' greedy tokens for an image prompt (the reference the torch engine is
held to).

Tiny sizes: 14-pixel patches merged 2x2; window_size 56 (2x2 merged units a window, so a 4x8-patch image attends in
two windows and the full-attention block sees both); four text layers with head_dim 16 (mrope_section [2, 3, 3])."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

TOKENS = 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>"]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 32
QWEN25_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
"""Qwen2.5-VL-Instruct's chat template as its chat_template.json publishes it (an image part renders as
<|vision_start|><|image_pad|><|vision_end|>; the processor repeats <|image_pad|> once per merged patch)."""


def write_qwen25_vl(root: Path, demo: Path, name: str = "qwen25-vl", *, published: bool = True) -> Path:
    """The checkpoint under root/name; demo: the demo model's directory (its byte tokenizer). published=False: the
    same weights as transformers 5's save_pretrained writes them (its config nests the language model's numbers in
    text_config, with rope_parameters; the tensors keep the published names)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    base = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    ids: dict[str, int] = {t: tok.token_to_id(t) or 0 for t in SPECIALS}
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": QWEN25_VL_TEMPLATE}))
    config = _published_config(base + len(SPECIALS), ids)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    hf: Any = transformers.AutoConfig.from_pretrained(str(path))
    hf.text_config.eos_token_id = None  # random weights would end some replies early
    model = transformers.Qwen2_5_VLForConditionalGeneration(hf).float().eval()
    with torch.no_grad():  # norms away from identity, so every one of them matters
        for key, weight in model.named_parameters():
            if key.endswith("norm.weight") or key.endswith("ln_q.weight"):
                weight.normal_(1.0, 0.5)
    if published:
        save_file({_published_name(k): v.contiguous() for k, v in model.state_dict().items()},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor"}))
    return path


def _published_config(vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json with the published file's keys (Qwen2.5-VL-3B-Instruct), at tiny sizes."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"], "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.2,
        "intermediate_size": 128, "max_position_embeddings": 512, "max_window_layers": 70,
        "model_type": "qwen2_5_vl", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
        "vision_config": {
            "depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "in_chans": 3, "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
            "spatial_patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2,
            "temporal_patch_size": 2, "initializer_range": 0.2},
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": vocab,
    }


def _published_name(key: str) -> str:
    """transformers 5's parameter name as the published safetensors name it."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("model.visual."):
        return key[len("model."):]
    return key


def picture(seed: int, width: int = 100, height: int = 60) -> bytes:
    """A seeded random RGB picture, PNG-encoded (100x60 resizes to 112x56: 4x8 patches, 2x4 image tokens)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def reference(path: Path, prompt: list[int], images: list[bytes]) -> list[int]:
    """transformers' Qwen2_5_VLForConditionalGeneration's greedy tokens for the expanded prompt and its images."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model: Any = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    kwargs: dict[str, Any] = {}
    if images:
        processor: Any = AutoImageProcessor.from_pretrained(str(path))
        pixels = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
        kwargs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
                  "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                         **kwargs)
    return [int(t) for t in out[0, len(prompt):]]
