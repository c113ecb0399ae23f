"""The catalog as clients list it, and cards built from a model's own config.json.

`GET /models` answers in Skulk's list shape (snake_case, as Skulk serves it) so Skulk clients show every
model by id; `POST /models/add` turns a Hugging Face checkpoint into a card with the numbers placement needs,
refusing architectures the engine cannot run rather than failing later inside a runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import check_config_numbers
from skulk.models.cards import is_custom
from skulk.models.memory_math import card_memory
from skulk.types.ids import ModelId
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

MB = 1024**2
_DTYPES = {"float32", "bfloat16", "float16"}


class UnsupportedArchitecture(ValueError):
    """The model's architecture is not one the engine runs; the message names it and the supported ones."""


def list_entry(
    card: ModelCard, *, created: int, where: dict[str, Any], context_length: int | None = None
) -> dict[str, Any]:
    """One model in Skulk's list shape; `where` adds this node's copies (downloaded, staged). context_length: what
    the placed instances admit (state.queries.served_context; None: the model's own)."""
    org, _, name = card.model_id.rpartition("/")
    return {
        "id": card.model_id,
        "object": "model",
        "created": created,
        "owned_by": org or "skulk",
        "hugging_face_id": None if card.builtin else card.model_id,
        "name": name,
        "description": f"{card.family} · {card.n_layers} layers · {card.storage_size.in_bytes / 1e9:.2f} GB",
        "context_length": card.context_length if context_length is None else context_length,
        "tags": [card.family, card.dtype] + (["builtin"] if card.builtin else []),
        "storage_size_megabytes": round(card.storage_size.in_bytes / MB),
        "supports_tensor": card.supports_tensor,
        "tasks": list(card.tasks),
        "is_custom": is_custom(card.model_id),
        "family": card.family,
        "quantization": card.quantization,
        "base_model": card.model_id,
        "capabilities": ["embedding"] if card.embeds else ["text"],
        **where,
    }


def card_from_config(
    model_id: str, config: dict[str, Any], weight_bytes: int, tensors: Mapping[str, int] | None = None
) -> ModelCard:
    """A card from config.json and the bytes of the safetensors; UnsupportedArchitecture for anything the
    torch engine (Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Gemma 3, Qwen3-MoE) cannot run. A multimodal Gemma 3
    is carded by its language model (text_config, transformers' defaults filled in): the engine runs only that.
    The engine's config readers are imported here, not at the top: they live beside torch, which the node process
    never otherwise loads (6 s and ~280 MB at start on a loaded machine)."""
    from skulk.engines.torch.bert import ENCODER_MODEL_TYPES
    from skulk.engines.torch.config import SLIDING, SUPPORTED_MODEL_TYPES, text_config, window_fields
    from skulk.engines.torch.quant import quant_spec

    check_config_numbers(config, f"{model_id}'s config.json")
    model_type = str(config.get("model_type", ""))
    if model_type in ENCODER_MODEL_TYPES:
        return encoder_card(model_id, config, weight_bytes)
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = ", ".join(config.get("architectures") or []) or "none given"
        raise UnsupportedArchitecture(
            f"{model_id} is a {model_type or 'model without model_type'} model (architectures: {architectures}); "
            f"the engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models and {', '.join(ENCODER_MODEL_TYPES)} "
            "sentence encoders"
        )
    try:
        quant_spec(config, None)
    except ValueError as exc:
        raise UnsupportedArchitecture(f"{model_id}: {exc}") from exc
    quantization = config.get("quantization_config") or config.get("quantization")
    memory = card_memory(config, weight_bytes, tensors)  # tensors: name -> bytes, where the headers were read
    config = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if not config.get(k)]
    if missing:
        raise InvalidModelFile(f"{model_id}'s config.json has no {', '.join(missing)}")
    heads = int(config["num_attention_heads"])
    window = window_fields(config, str(config.get("model_type", "")))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelCard(
        model_id=ModelId(model_id),
        family=model_type,
        n_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        storage_size=Memory.from_bytes(weight_bytes),
        dtype=dtype if dtype in _DTYPES else "bfloat16",  # type: ignore[arg-type]
        quantization="none" if not quantization else str(quantization.get("bits", "quantized")),
        context_length=int(config.get("max_position_embeddings") or 4096),
        vocab_size=int(config["vocab_size"]) if config.get("vocab_size") else None,
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        sliding_window=window.get("sliding_window"),
        sliding_layers=[i for i, kind in enumerate(window.get("layer_types", ())) if kind == SLIDING],
        memory=memory,
        supports_tensor=True,
        builtin=False,
    )


def encoder_card(model_id: str, config: dict[str, Any], weight_bytes: int) -> ModelCard:
    """A BERT-family sentence encoder (all-MiniLM-L6-v2, bge-small-en-v1.5): an embedding model, one node,
    its dimension the hidden size; UnsupportedArchitecture for a BERT variant the encoder does not run."""
    from skulk.engines.torch.bert import BertArgs  # beside torch: see card_from_config

    try:
        args = BertArgs.from_config(config)
    except (ValueError, KeyError) as exc:
        raise UnsupportedArchitecture(f"{model_id}: {exc}") from exc
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return ModelCard(
        model_id=ModelId(model_id), family=str(config["model_type"]), n_layers=args.num_hidden_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_attention_heads, storage_size=Memory.from_bytes(weight_bytes),
        dtype=dtype if dtype in _DTYPES else "float32",  # type: ignore[arg-type]
        context_length=args.max_position_embeddings, vocab_size=args.vocab_size, supports_tensor=False,
        tasks=["TextEmbedding"],
    )


def weight_bytes(files: dict[str, int], index: dict[str, Any] | None) -> int:
    """The bytes of the weights: the index's total_size when it has one, else the safetensors files' sizes."""
    total = (index or {}).get("metadata", {}).get("total_size")
    if isinstance(total, int) and total > 0:
        return total
    return sum(size for name, size in files.items() if name.endswith(".safetensors"))
