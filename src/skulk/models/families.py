"""Which engines run a model's family: a pure decision over its config.json.

The torch engine runs its native families (engines/torch/models.SUPPORTED_MODEL_TYPES); the MLX engine runs every
family mlx-lm's own registry loads: the model module `mlx_lm.models.<type>` after mlx-lm's remapping of model
types (kimi_k2 → deepseek_v3, minimax_m2 → minimax, ...). That registry is read by the MLX probe's child
interpreter (engines/mlx/registry.py), which the node starts anyway, so the node process never imports MLX.
The catalog accepts a model some engine runs and writes which into the card (`compatible_backends`); a family
none runs is refused with the engines that would and what to install.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skulk.types.backends import ENGINE_LABELS, ENGINES, INSTALL, EngineName
from skulk.types.models import Split


@dataclass(frozen=True, slots=True)
class MlxRegistry:
    """mlx-lm's model registry as its loader reads it (mlx_lm.utils._get_classes): the model modules it ships,
    its model-type remapping and its (model type, architecture) remapping."""

    version: str
    modules: frozenset[str]
    remapping: Mapping[str, str] = field(default_factory=dict)
    architecture_remapping: Mapping[tuple[str, str], str] = field(default_factory=dict)
    tensor: frozenset[str] = frozenset()
    """Modules whose Model has mlx-lm's `shard(group)`: Tensor over MLX ranks."""
    pipeline: frozenset[str] = frozenset()
    """Modules whose decoder stack is an mlx-lm PipelineMixin: cut anywhere, it re-derives its layer indices."""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MlxRegistry:
        """The registry from the probe child's JSON (engines/mlx/registry.py)."""
        return cls(
            version=str(data.get("version", "?")),
            modules=frozenset(str(m) for m in data.get("modules", ())),
            remapping={str(k): str(v) for k, v in dict(data.get("remapping") or {}).items()},
            architecture_remapping={(str(t), str(a)): str(m) for t, a, m in data.get("architecture_remapping", ())},
            tensor=frozenset(str(m) for m in data.get("tensor", ())),
            pipeline=frozenset(str(m) for m in data.get("pipeline", ())),
        )

    def module_for(self, model_type: str, architectures: Collection[str] = ()) -> str:
        """The module mlx-lm would import for this config: an architecture remapping first, else the type's."""
        for architecture in architectures:
            found = self.architecture_remapping.get((model_type, architecture))
            if found is not None:
                return found
        return self.remapping.get(model_type, model_type)

    def runs(self, model_type: str, architectures: Collection[str] = ()) -> bool:
        return bool(model_type) and self.module_for(model_type, architectures) in self.modules


    def splits(self, model_type: str, architectures: Collection[str], uniform: bool) -> list[Split]:
        """How MLX ranks can split this family: Tensor where its module has `shard`; Pipeline where its stack
        is a PipelineMixin or every layer is alike (a plain slice of `model.layers` then keeps mlx-lm's cache
        and masks right: a mixed stack indexes its layers by position, as Gemma 3's window layers and gpt-oss'
        cache list do)."""
        module = self.module_for(model_type, architectures)
        found: list[Split] = []
        if module in self.pipeline or (uniform and module in self.modules):
            found.append("Pipeline")
        if module in self.tensor:
            found.append("Tensor")
        return found


def uniform_layers(kinds: Sequence[str] | None, n_layers: int, sliding_layers: Collection[int]) -> bool:
    """Every decoder layer keeps its past the same way (types/model_memory.LayerKind): a Llama, Qwen or DeepSeek
    stack, not Gemma's or gpt-oss' alternating windows or a hybrid's recurrent layers. None: kinds not known."""
    if 0 < len(sliding_layers) < n_layers:
        return False
    return kinds is None or len(set(kinds)) <= 1


def architectures_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    found = config.get("architectures") or ()
    return (found,) if isinstance(found, str) else tuple(str(a) for a in found)


def mlx_layout_refusal(config: Mapping[str, Any], tensors: Collection[str] | None = None) -> str | None:
    """Why mlx-lm's module for this family cannot read this checkpoint's weights although its registry has the
    family (None: it can), from config.json and the tensor names where the headers were read (pure):
    - gpt-oss: mlx-lm's loader converts the experts as OpenAI ships them (MXFP4 blocks and scales) or takes them
      already converted (an mlx-community checkpoint); transformers' float layout (`experts.gate_up_proj`, a bf16
      re-upload) it maps to names its model does not have;
    - llama4_text: mlx-lm's module is the dense text model; a mixture-of-experts Llama 4 loads as `llama4` (the
      published multimodal layout), not as a text-only checkpoint with experts."""
    model_type = config.get("model_type")
    names = tensors or ()
    if model_type == "gpt_oss":
        quant = config.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        converted = "quantization" in config or any(n.endswith("experts.gate_proj.weight") for n in names)
        if method != "mxfp4" and not converted:
            return ("mlx-lm reads gpt-oss's experts in OpenAI's MXFP4 layout or converted by mlx-lm, not "
                    "transformers' float layout (experts.gate_up_proj)")
    if model_type == "llama4_text" and int(config.get("num_local_experts") or 0) > 0:
        return ("mlx-lm's llama4_text is the dense text model; a Llama 4 with experts loads in the published "
                "multimodal layout (model_type llama4)")
    return None


def engines_running(
    config: Mapping[str, Any], torch_types: Collection[str], mlx: MlxRegistry | None,
    tensors: Collection[str] | None = None,
) -> tuple[EngineName, ...]:
    """The engines that run this config's family, in ENGINES order: torch when its model_type is one of
    `torch_types`, MLX when mlx-lm's registry loads it and its module reads this layout (mlx_layout_refusal;
    registry None: mlx-lm is not installed here, so MLX is not claimed)."""
    model_type = str(config.get("model_type") or "")
    claims: dict[EngineName, bool] = {
        "torch": model_type in torch_types,
        "mlx": (mlx is not None and mlx.runs(model_type, architectures_of(config))
                and mlx_layout_refusal(config, tensors) is None),
    }
    return tuple(e for e in ENGINES if claims[e])


def refusal(
    model_id: str, config: Mapping[str, Any], torch_types: Collection[str], mlx: MlxRegistry | None,
    torch_reason: str | None = None,
) -> str:
    """Why no engine runs this model, naming each engine, what it runs and what to install: the 400 of
    POST /models/add (unsupported_architecture). `torch_reason`: the torch engine knows the family but not
    this checkpoint (its quantization)."""
    model_type = str(config.get("model_type") or "")
    architectures = ", ".join(architectures_of(config)) or "none given"
    head = f"{model_id} is a {model_type or 'model without model_type'} model (architectures: {architectures})"
    torch = torch_reason or f"{ENGINE_LABELS['torch']} runs {', '.join(torch_types)}"
    if mlx is None:
        how = (f"{ENGINE_LABELS['mlx']} runs the families mlx-lm loads, and mlx-lm is not installed on this node "
               f"({INSTALL['mlx']})")
    else:
        how = (f"{ENGINE_LABELS['mlx']} runs {len(mlx.modules)} families and mlx-lm {mlx.version} has no model "
               f"module {mlx.module_for(model_type, architectures_of(config))!r}; a newer mlx-lm may "
               "(pip install -U mlx-lm)")
    return f"{head}; no engine runs it: {torch}; {how}."


def attention_shape(config: Mapping[str, Any]) -> tuple[int, int | None]:
    """(KV heads, head width) for the card. Multi-head latent attention (DeepSeek V2/V3, Kimi K2) has no grouped
    KV heads: every query head gets its own key (qk_nope_head_dim + qk_rope_head_dim wide) once the latent is
    expanded, so the card says so rather than the config's num_key_value_heads/head_dim, which transformers
    fills with other meanings (head_dim = the rope part). An upper bound on MLA's cache until the per-family
    memory arithmetic sizes it."""
    heads = int(config["num_attention_heads"])
    if config.get("kv_lora_rank"):
        return heads, int(config.get("qk_nope_head_dim") or 0) + int(config.get("qk_rope_head_dim") or 0) or None
    return int(config.get("num_key_value_heads") or heads), int(config["head_dim"]) if config.get("head_dim") else None



def fallback_refusal(config: Mapping[str, Any], causal_lms: Mapping[str, str]) -> str | None:
    """None when the torch engine's transformers fallback (engines/torch/fallback.py) runs this checkpoint, else
    why not. `causal_lms`: transformers' own model_type -> causal-LM class table (engines/torch/fallback_types).
    The checkpoint must have been saved from such a class (its `architectures`), so its tensor names are the ones
    AutoModelForCausalLM reads (a multimodal Llama 4's are not), and be unquantized: transformers reads FP8 and
    MXFP4 weights on GPUs only."""
    model_type = str(config.get("model_type") or "")
    if model_type not in causal_lms:
        return f"transformers {'is not installed' if not causal_lms else f'has no causal LM for {model_type!r}'}"
    classes = set(causal_lms.values())
    saved = [a for a in architectures_of(config) if a not in classes]
    if saved:
        return f"its architectures ({', '.join(saved)}) are not a causal LM transformers builds"
    quantized = config.get("quantization_config") or config.get("quantization")
    if quantized:
        method = quantized.get("quant_method", "quantized") if isinstance(quantized, Mapping) else "quantized"
        return f"its weights are {method}, and the transformers fallback runs unquantized checkpoints only"
    return None


def fallback_splits(config: Mapping[str, Any]) -> bool:
    """The transformers fallback can split this checkpoint as a Pipeline (engines/torch/fallback_stage.py): its
    decoder layers take only the hidden states, not also the token ids (Gemma 3n's and Gemma 4's per-layer inputs,
    hidden_size_per_layer_input, are looked up from the ids and projected from the first stage's embeddings), and
    none reads another layer's cache (their num_kv_shared_layers reuse an earlier layer's keys and values, which
    another stage would hold)."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    return not any(text.get(key) or config.get(key) for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"))
