"""What Ollama's /api/show says about a model beyond its card: its capabilities, chat template, file format and
quantization, read from this node's copy of the files so they are the model's own, not placeholders.

- `capabilities`: `embedding` for an embedding model; otherwise `completion`, and `tools` when the chat template
  has a tools section (the engine's probe: offering a tool changes what the template renders). Without local
  files the template cannot be probed, so only `completion` is claimed; `vision` for a card with `vision` (it reads
  `images`).
- `template`: the model's Jinja chat template text (tokenizer_config.json's, or chat_template.jinja); empty
  without local files. Ollama's own templates are Go templates; a client reads this one as text.
- `format`: `gguf` for a model whose files are a GGUF file (an import, the packaged default), else `safetensors`.
- `quantization_level`: a GGUF file's own file type (`Q4_1`, `Q8_0`, `F16`), else the card's: `BF16`/`F16`/`F32`
  for float weights, `Q4`/`Q8` for quantized ones (an MLX checkpoint's bits, or weights quantized at load)."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

from skulk.api.model_facts import model_dir
from skulk.api.services import ApiServices
from skulk.api.tokens import local_tokenizer
from skulk.types.models import ModelCard

GGUF_NAME = "model.gguf"
FLOAT_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def gguf_file(where: Path | None) -> Path | None:
    """The model's GGUF file on this node, if its copy is one."""
    path = where / GGUF_NAME if where is not None else None
    return path if path is not None and path.is_file() else None


@functools.lru_cache(maxsize=32)
def gguf_file_type(path: Path, mtime: float) -> str | None:
    """A GGUF file's `general.file_type` as llama.cpp names it (MOSTLY_Q4_1 → Q4_1); None when it has none.
    Keyed by mtime so a replaced file is read again."""
    del mtime
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).get_field("general.file_type")
    if field is None:
        return None
    try:
        return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
    except ValueError:
        return None


def card_quantization(card: ModelCard) -> str:
    """The card's quantization in Ollama's words: float weights by their dtype, quantized ones by their bits."""
    bits = card.quantize_at_load or (card.quantization if card.quantization != "none" else None)
    if bits is None:
        return FLOAT_LEVELS.get(card.dtype, card.dtype.upper())
    return f"Q{bits.removeprefix('int')}"


TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")
"""Where a model's files carry its chat template (the first wins)."""


def chat_template_text(where: Path | None) -> str:
    """The model's chat template as its files carry it (a separate chat_template.jinja wins, as transformers')."""
    if where is None:
        return ""
    jinja = where / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        config = json.loads((where / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one is the chat template
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else ""


def file_facts(node: ApiServices, card: ModelCard) -> dict[str, str]:
    """Ollama's `format` and `quantization_level` of the model's copy on this node (the card's without one)."""
    gguf = gguf_file(model_dir(node, card))
    level = gguf_file_type(gguf, gguf.stat().st_mtime) if gguf is not None else None
    return {"format": "gguf" if gguf is not None else "safetensors",
            "quantization_level": level or card_quantization(card)}


async def capabilities(node: ApiServices, card: ModelCard) -> list[str]:
    if card.embeds:
        return ["embedding"]
    tokenizer = await local_tokenizer(node, card.model_id)
    tools = tokenizer is not None and await asyncio.to_thread(lambda: tokenizer.renders_tools)
    found = ["completion", "tools"] if tools else ["completion"]
    return [*found, "vision"] if card.vision else found  # Ollama's word for a model that reads `images`


async def template(node: ApiServices, card: ModelCard) -> str:
    return await asyncio.to_thread(chat_template_text, model_dir(node, card))
