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
from skulk.models.families import (
    architectures_of,
    attention_shape,
    engines_running,
    fallback_refusal,
    fallback_splits,
    mlx_layout_refusal,
    refusal,
    uniform_layers,
)
from skulk.models.memory_math import card_memory, kinds_of, torch_dequantized_growth
from skulk.types.backends import ENGINES, EngineName, backends_for
from skulk.types.ids import ModelId
from skulk.types.memory import Memory
from skulk.types.models import ModelCard, Split

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
        "compatible_backends": card.compatible_backends,
        "torch_runtime": card.torch_runtime,
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
    """A card from config.json and the bytes of the safetensors, accepted when some engine runs its family
    (models/families.py: the torch engine its native families, the MLX engine what mlx-lm's registry loads);
    its compatible_backends say which (None: every engine). UnsupportedArchitecture, naming the engines and what
    to install, when none does. A multimodal Gemma 3 is carded by its language model (text_config,
    transformers' defaults filled in): the engines run only that. The torch engine's config readers are
    imported here, not at the top: they live beside torch, which the node process never otherwise loads (6 s
    and ~280 MB at start on a loaded machine). `tensors` (name -> bytes, where the safetensors headers were
    read) gives the card's per-layer memory its real bytes (models/memory_math.py)."""
    from skulk.engines.torch.bert import ENCODER_MODEL_TYPES

    check_config_numbers(config, f"{model_id}'s config.json")
    model_type = str(config.get("model_type", ""))
    if model_type in ENCODER_MODEL_TYPES:
        return encoder_card(model_id, config, weight_bytes)
    engines = _engines(model_id, config, tensors)
    fallback = "torch" in engines and model_type not in native_types()
    splits = fallback_splits(config) if fallback else None  # the whole config: Gemma 4 nests its text settings
    module_of = (model_type, architectures_of(config))  # mlx-lm picks its module by the outer config
    from skulk.engines.torch.config import SLIDING, is_vision_config, text_config, window_fields

    quantization = config.get("quantization_config") or config.get("quantization")
    memory = card_memory(config, weight_bytes, tensors)  # tensors: name -> bytes, where the headers were read
    growth = torch_dequantized_growth(config) if "torch" in engines else 0  # MXFP4 dequantized, FP8 at 8 bits
    kinds = kinds_of(config)  # each layer's kind, whether or not the arithmetic accounts for its bytes
    vision = is_vision_config(config)
    config = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if not config.get(k)]
    if missing:
        raise InvalidModelFile(f"{model_id}'s config.json has no {', '.join(missing)}")
    kv_heads, head_dim = attention_shape(config)
    window = window_fields(config, str(config.get("model_type", "")))
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    n_layers = int(config["num_hidden_layers"])
    sliding = [i for i, kind in enumerate(window.get("layer_types", ())) if kind == SLIDING]
    return ModelCard(
        model_id=ModelId(model_id),
        family=model_type,
        n_layers=n_layers,
        hidden_size=int(config["hidden_size"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=kv_heads,
        storage_size=Memory.from_bytes(weight_bytes),
        torch_storage_size=Memory.from_bytes(weight_bytes + growth) if growth else None,
        dtype=dtype if dtype in _DTYPES else "bfloat16",  # type: ignore[arg-type]
        quantization="none" if not quantization else str(quantization.get("bits", "quantized")),
        context_length=int(config.get("max_position_embeddings") or 4096),
        vocab_size=int(config["vocab_size"]) if config.get("vocab_size") else None,
        head_dim=head_dim,
        sliding_window=window.get("sliding_window"),
        sliding_layers=sliding,
        memory=memory,
        supports_tensor=True,
        mlx_splits=_mlx_splits(module_of, engines, uniform_layers(kinds, n_layers, sliding)),
        builtin=False,
        compatible_backends=backends_for(engines),
        torch_runtime="transformers" if fallback else "native",
        fallback_splits=splits,
        vision=vision,
    )


def _mlx_splits(
    module_of: tuple[str, tuple[str, ...]], engines: tuple[EngineName, ...], uniform: bool
) -> list[Split] | None:
    """How MLX ranks split this family, from mlx-lm's own module (families.MlxRegistry.splits); None where the
    MLX engine does not run it or does not run here (placement then offers MLX no split it has not read)."""
    if "mlx" not in engines:
        return None
    from skulk.engines import mlx as mlx_engine

    registry = mlx_engine.model_registry()
    if registry is None:
        return None
    return registry.splits(*module_of, uniform)


def native_types() -> tuple[str, ...]:
    """The families the torch engine runs with its own kernels (the rest it runs through transformers)."""
    from skulk.engines.torch.models import SUPPORTED_MODEL_TYPES

    return SUPPORTED_MODEL_TYPES


def _engines(model_id: str, config: dict[str, Any], tensors: Mapping[str, int] | None = None
             ) -> tuple[EngineName, ...]:
    """The engines that run this checkpoint (families.engines_running); UnsupportedArchitecture naming every
    engine when none does. A torch-native family runs on every engine (mlx-lm loads each of them, in the layouts
    families.mlx_layout_refusal allows) unless its quantization is one the torch kernels do not read; only then,
    or for a family torch does not run, is mlx-lm's registry asked (the node's MLX probe, a child interpreter: a
    GGUF import never starts one)."""
    from skulk.engines import mlx as mlx_engine
    from skulk.engines.torch.fallback_types import causal_lm_classes
    from skulk.engines.torch.quant import quant_spec

    native = native_types()
    torch_reason = None
    model_type = str(config.get("model_type", ""))
    if model_type in native:
        try:
            quant_spec(config, None)
            return ENGINES if mlx_layout_refusal(config, tensors) is None else ("torch",)
        except ValueError as exc:
            torch_reason = f"the torch engine cannot load it: {exc}"
    torch_types: tuple[str, ...] = ()
    if torch_reason is None:
        fallback_reason = fallback_refusal(config, causal_lm_classes())
        torch_types = (model_type,) if fallback_reason is None else ()
        torch_reason = None if fallback_reason is None else (
            f"the torch engine runs {', '.join(native)} natively and other families through "
            f"transformers' modeling, but not this one: {fallback_reason}")
    registry = mlx_engine.model_registry()
    engines = engines_running(config, torch_types, registry, tensors)
    if not engines:
        raise UnsupportedArchitecture(refusal(model_id, config, native, registry, torch_reason))
    return engines


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
