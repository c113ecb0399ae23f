"""What placement and engines need to know about a model, independent of where its bytes are."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .backends import BackendTag
from .base import CamelModel
from .ids import ModelId
from .memory import Memory
from .model_memory import ModelMemory

Split = Literal["Pipeline", "Tensor"]
"""A Sharding's value (types/instances.Sharding, which imports this module)."""

DType = Literal["float32", "bfloat16", "float16"]
KvCacheBits = Literal[16, 8, 4]
"""kv_cache_bits: how an instance stores its KV cache: 16, the model's own float dtype; 8 or 4, quantized keys and
values with float16 scales (engines/kv_pools.py: the bytes a position costs), about 1/2 or 1/3.5 of bf16's."""
QuantizeAtLoad = Literal["int4", "int8"]
ModelTask = Literal["TextGeneration", "TextEmbedding"]
"""What a model serves: text generation (chat, completions) or text embedding (POST /v1/embeddings)."""
ToolParserName = Literal[
    "hermes", "qwen3_coder", "llama3", "mistral", "deepseek_v31", "kimi_k2", "glm45", "harmony"
]
"""The tool-call formats the API reads (tool_parsers/), as a card's `tool_parser` names them."""


class ModelCard(CamelModel):
    model_id: ModelId
    family: str
    n_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    storage_size: Memory
    mlx_storage_size: Memory | None = None
    """What an MLX rank loads when it is not the files: a GGUF import's bf16 export (models/gguf_export.py,
    mlx-lm reads no GGUF blocks; about 3.5x a 4-bit file). None: an MLX rank loads the files, as torch does
    (a float checkpoint, or an mlx-community quantized one as it ships)."""
    torch_storage_size: Memory | None = Field(default=None, exclude_if=lambda v: v is None)
    """What a torch rank loads when it is not the files: OpenAI's gpt-oss, whose MXFP4 experts the torch engine
    dequantizes to the model's float dtype while loading (engines/torch/mxfp4.py; about 3.8x their packed bytes).
    None: a torch rank loads the files."""
    dtype: DType = "bfloat16"
    quantization: str = "none"
    context_length: int = 4096
    """The model's own context (max_position_embeddings); a placement's max_context can only lower it."""
    vocab_size: int | None = None
    """Tokens the model knows; bounds a request's top_k at the API (None: unknown, the engine clamps)."""
    layer_bytes: int | None = None
    """All decoder layers' weight bytes as the engine reads them, and head_bytes the lm_head's (tied or not) and
    final norm's, which the last rank reads every decode step: measured from the tensors where an import read them
    (a GGUF file's layers and head are often quantized apart). None: placement estimates both from storage_size
    and vocab_size (master/balance.decode_bytes)."""
    head_bytes: int | None = None
    head_dim: int | None = None
    """Width of one attention head when the config sets it apart from hidden_size / heads (Qwen3, Gemma 3):
    the KV cache is sized by it. None: hidden_size // num_attention_heads."""
    sliding_window: int | None = None
    """The window of the layers that attend through one (sliding_layers): the torch engine keeps a hybrid model's
    sliding layers' KV in a pool of their own, holding only the window's positions (engines/kv_pools.py), and
    placement sizes it so. None: no window."""
    sliding_layers: list[int] = []
    """The layers attending through sliding_window (Gemma 3's local layers; Mistral v0.1's every layer)."""
    memory: ModelMemory | None = None
    """Each decoder layer's kind, KV or state, and real weight bytes, with the embedding, head and unrun layers
    apart (models/memory_math.py, from config.json or the tensors): placement sums a rank's own layers instead of
    splitting storage_size evenly and sizing KV as a Llama's. None: the Llama-shaped estimate (every layer alike,
    weights storage_size x layers / n_layers, KV from the heads above)."""
    supports_tensor: bool = True
    quantize_at_load: QuantizeAtLoad | None = None
    """Float weights the engine quantizes while loading (weight-only int4/int8); storage_size is then the
    quantized estimate, which placement fits into node memory."""
    kv_cache_bits: KvCacheBits | None = None
    """The KV cache as the instance keeps it (a placement's kv_cache_bits, set on the card placement runs, as
    quantize_at_load is): placement sizes the pool at these bits and the torch engine stores keys and values so.
    None: 16 (the model's dtype)."""
    builtin: bool = False
    mlx_splits: list[Split] | None = None
    """How several MLX ranks can split this family, read from mlx-lm's own model module when the card was made
    (models/families.MlxRegistry.splits): Tensor where it has `shard`, Pipeline where its layers can be cut.
    None: not read (a card from an older build): Pipeline where every layer is alike, Tensor not offered."""
    compatible_backends: list[BackendTag] | None = None
    """Skulk's hard filter: only nodes advertising one of these tags may run the model (None: any engine)."""
    torch_runtime: Literal["native", "transformers"] = "native"
    """How the torch engine runs the family: "native", its own kernels, paged cache and batching, split over
    nodes; "transformers", through transformers' own modeling code (engines/torch/fallback.py): correct but
    slower, one request per forward pass, split as a Pipeline where fallback_splits says so."""
    fallback_splits: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    """Whether the fallback splits the family by decoder layers over Pipeline ranks (engines/torch/fallback_stage.py):
    False where its layers read the token ids beside the hidden states (Gemma 4's per-layer inputs). None: a card
    from a build before the split, or a native family; left out of the wire then, so a node one release behind
    still reads the card (types/versions.py)."""
    backend_preference: list[BackendTag] = []
    """Skulk's soft order: under engine `auto`, the first of these every node of a ring can run wins."""
    kv_cache_gb: float | None = None
    """The KV pool a placement of this model reserves when the placement itself sets none (None: placement's
    default share of free memory, kv_pools.DEFAULT_KV_FRACTION)."""
    draft_model: ModelId | None = None
    """A smaller model of the same tokenizer that drafts tokens for this one (speculative decoding, Skulk's
    "assistant drafter" companion). Used by a single-rank torch instance when the draft's files are on the node
    (the store, staging or models folder, like the target's); placement counts its weights and KV on that rank.
    Never downloaded for the target: place it once, or copy it in. None: prompt lookup drafts."""
    reasoning_parser: Literal["think", "harmony", "none"] | None = None
    """How replies split into reasoning and content (engines/reasoning.py): "think" reads <think> blocks,
    "harmony" gpt-oss's analysis channel, "none" never splits. None: decided from the chat template (a template
    that writes <think> thinks in it; one that writes <|channel|> is harmony)."""
    tool_parser: ToolParserName | None = None
    """The format the model writes tool calls in (tool_parsers/). None: picked from the chat template's
    markers where the API node has the template, else from the family name."""
    vision: bool = Field(default=False, exclude_if=lambda v: not v)
    """A vision-language checkpoint whose images the engines read (engines/torch/vision.py's tower on rank 0; the
    MLX engine feeds its embeddings to mlx-lm's Gemma 3, engines/mlx/vision.py); any other model answers an
    image with `text_only`. Left out of the card while False, so a node of
    format version 1 still reads every other card (types/versions.py)."""
    tasks: list[ModelTask] = ["TextGeneration"]
    """Skulk's `tasks` of the card. An embedding model (TextEmbedding) answers only embeddings, runs on one
    node, and a chat model answers no embeddings: the API refuses either mix-up with a 400."""

    @property
    def embeds(self) -> bool:
        return "TextEmbedding" in self.tasks
