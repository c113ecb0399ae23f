"""A seeded random Gemma 3 vision-language checkpoint in transformers 5's own layout (Gemma3ForConditionalGeneration:
config with text_config and vision_config, safetensors, preprocessor_config.json), with a byte tokenizer that has
Gemma 3's special tokens and Gemma 3's published chat template; and transformers' greedy tokens for an image prompt
(the reference the torch engine is held to).

Tiny sizes: a 32x32 image in 8x8 patches (16 patches) pooled to 4 image tokens; four text layers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

TOKENS = 8
IMAGE_TOKENS = 4
SPECIALS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"]
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
"""Gemma 3's chat template as google/gemma-3-4b-it publishes it (an image part renders as <start_of_image>)."""


def write_gemma3_vlm(root: Path, demo: Path, name: str = "gemma3-vlm", layers: int = 4) -> Path:
    """The checkpoint under root/name; demo: the demo model's directory (its byte tokenizer). layers: 6 gives
    Gemma 3's published pattern (five sliding layers, then a full one), which mlx-lm's Gemma 3 needs."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    base = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "pad_token": "<pad>",
        "chat_template": GEMMA3_TEMPLATE}))
    torch.manual_seed(0)
    no_eos: dict[str, Any] = {"eos_token_id": None}  # random weights would end some replies early
    config = transformers.Gemma3Config(
        text_config={"vocab_size": base + len(SPECIALS), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "sliding_window": 64, "max_position_embeddings": 256, "initializer_range": 0.2,
                     "bos_token_id": ids["<bos>"], "pad_token_id": None, "eos_token_id": None,
                     "tie_word_embeddings": False},  # tied, a random model repeats its last input token
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        initializer_range=0.2, tie_word_embeddings=False, **no_eos)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # the projector starts at zeros (images would change nothing), the norms at identity
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 3.0)
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.normal_(0, 0.5)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "resample": 2}))
    return path


def png(seed: int, size: int = 40) -> bytes:
    """A seeded random RGB picture, PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def reference(path: Path, prompt: list[int], images: list[bytes], tokens: int = TOKENS) -> list[int]:
    """transformers' Gemma3ForConditionalGeneration's greedy `tokens` for the expanded prompt and its images (none:
    a text prompt)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model: Any = Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    processor: Any = AutoImageProcessor.from_pretrained(str(path))
    ids = torch.tensor([prompt])
    seen: dict[str, Any] = {}
    if images:
        seen["pixel_values"] = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                                         return_tensors="pt")["pixel_values"]
        seen["token_type_ids"] = (ids == model.config.image_token_id).long()
    out = model.generate(input_ids=ids, **seen, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]
