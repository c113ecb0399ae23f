"""One Pipeline stage of a transformers model: the decoder layers [start, end) of the family's own modeling code,
with the embedding on the first stage and the final norm and head on the last (vLLM's Transformers backend and
transformers' own `apply_pipeline_parallelism` split the same way).

Built without ever holding the whole model: the model class is constructed the way from_pretrained constructs it
(on the meta device), the layers and ends this stage does not run are swapped for identities before anything is
allocated, and only the checkpoint tensors of what remains are read (lazily, from the files this node has: a
Pipeline rank stages only the files of its layers). transformers' own loading then applies the family's weight
conversions (fused experts and the like) to those tensors alone.

Each request keeps a transformers cache of the family's own kind for the whole model. The layers this stage skips
never write theirs, so their entries are made aliases of an owned layer of the same kind: the model's forward asks
layer 0 (or the first full or sliding one) how long the cache is and how large the masks must be, and on a later
stage layer 0 is someone else's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Skipped(nn.Module):
    """A module another stage runs: passes its first input through (a decoder layer's hidden states). It keeps the
    replaced module's plain attributes, which some families' forwards read off every layer (Nemotron-H picks each
    block's mask by its `block_type`)."""

    def __init__(self, replaced: nn.Module | None = None) -> None:
        super().__init__()
        for name, value in vars(replaced or nn.Module()).items():
            if not name.startswith("_") and isinstance(value, str | int | float | bool | tuple | type(None)):
                setattr(self, name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True)
class StageSpan:
    """The decoder layers [start, end) a stage runs, and whether it embeds ids (first) and computes logits (last)."""

    start: int
    end: int
    first: bool
    last: bool

    def owns(self, layer: int) -> bool:
        return self.start <= layer < self.end


FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "final_norm", "ln_f")
"""What families call the decoder's last norm (Nemotron-H: norm_f): the last stage's; the others send the hidden
states from before it."""


def decoder_of(model: Any) -> Any:
    """The module holding the decoder layers (`layers`), the embedding and the final norm: a causal LM's `model`
    (whatever its base_model_prefix says: Llama 4's names the multimodal wrapper's), or its decoder."""
    for found in (getattr(model, "model", None), getattr(model, model.base_model_prefix, None), model.get_decoder()):
        if hasattr(found, "layers"):
            return found
    raise ValueError(f"{type(model).__name__} has no decoder layers to split")


def cut(model: Any, span: StageSpan) -> None:
    """Swap what this stage does not run for Skipped, before the weights are allocated."""
    decoder = decoder_of(model)
    tied = tied_head(model.config)
    if not (span.first or (tied and span.last)):  # a tied head is read from the embedding's tensor
        decoder.embed_tokens = Skipped()
    for i in range(len(decoder.layers)):
        if not span.owns(i):
            decoder.layers[i] = Skipped(decoder.layers[i])
    if not span.last:
        for name in FINAL_NORMS:
            if hasattr(decoder, name):
                setattr(decoder, name, Skipped())
        model.lm_head = Skipped()
        if tied:
            model.all_tied_weights_keys = {}


def tied_head(config: Any) -> bool:
    """The head reads the embedding's tensor (tie_word_embeddings, on the model's or its text config)."""
    return bool(getattr(config, "tie_word_embeddings", False) or
                getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False))


def stage_class(base: type) -> type:
    """`base` with a constructor that cuts the model to the stage in `_span` right after building it (on the meta
    device, inside from_pretrained), so from_pretrained allocates and loads only what is left."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        cut(self, type(self)._span)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})


def owned_key(key: str, span: StageSpan, prefix: str, tied: bool) -> bool:
    """Whether a checkpoint tensor belongs to this stage: its layers', the embedding on the first (and on a tied
    last), the final norm and head on the last, and the decoder's other small parts (Gemma 4's per-layer input
    tables) on every stage. Keys outside the decoder (a multimodal wrapper's towers) are not read: the fallback
    runs text."""
    if key.startswith("lm_head."):
        return span.last
    if not key.startswith(prefix):
        return False
    part, _, rest = key.removeprefix(prefix).partition(".")
    if part == "layers":
        index = rest.partition(".")[0]
        return index.isdigit() and span.owns(int(index))
    if part == "embed_tokens":
        return span.first or (tied and span.last)
    return span.last or part not in FINAL_NORMS


def lazy_tensors(model_dir: Path, span: StageSpan, prefix: str, tied: bool) -> tuple[dict[str, Any], list[Any]]:
    """The stage's checkpoint tensors as safetensors slices (read only when transformers loads them), from the
    files present, and the open files (kept open until loading ends)."""
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    handles = []
    for path in sorted(model_dir.glob("*.safetensors")):  # another stage's files may not be on this node
        handle = safe_open(str(path), framework="pt", device="cpu")
        handles.append(handle)
        names = handle.keys()  # a safetensors handle is not iterable
        for key in names:
            if owned_key(key, span, prefix, tied):
                tensors[key] = handle.get_slice(key)
    return tensors, handles


def checkpoint_prefix(model_dir: Path, model_cls: type) -> str:
    """The checkpoint's name for the decoder's keys ("model." for a causal LM, "model.language_model." for a
    multimodal wrapper's text model; never Qwen's multi-token-prediction block, mtp.layers.*, which no rank runs)."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names = handle.keys()  # a safetensors handle is not iterable
            for key in names:
                head, sep, _ = key.partition("layers.")
                if sep and head.endswith(".") and head != "mtp.":
                    return head
    return f"{getattr(model_cls, 'base_model_prefix', 'model')}."


def load_stage(model_dir: Path, span: StageSpan) -> Any:
    """The stage's model: the family's causal-LM class, cut to the span, with only its tensors loaded."""
    import transformers
    from transformers import AutoConfig

    from skulk.models.families import fallback_splits

    from .fallback_types import causal_lm_classes

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if not (span.first and span.last) and not fallback_splits(config.to_dict()):
        raise ValueError(f"{config.model_type}'s layers read the token ids beside the hidden states (per-layer "
                         "inputs) or another layer's cache: it runs on one rank, not split")
    base = getattr(transformers, causal_lm_classes()[config.model_type])
    text = config.get_text_config(decoder=True)
    if text is not config and getattr(base, "config_class", None) is type(text):
        config = text  # a multimodal checkpoint's text model (Qwen3.5's layout), as AutoModelForCausalLM takes it
    cls = stage_class(base)
    cls._span = span
    tensors, handles = lazy_tensors(model_dir, span, checkpoint_prefix(model_dir, base), tied_head(config))
    try:
        model, info = cls.from_pretrained(None, config=config, state_dict=tensors, dtype="auto",
                                          output_loading_info=True)
    finally:
        del handles
    if info.get("missing_keys"):  # transformers would have left them randomly initialised
        missing = sorted(info["missing_keys"])
        raise FileNotFoundError(f"{model_dir.name}: this stage's tensors {', '.join(missing[:5])}"
                                f"{' ...' if len(missing) > 5 else ''} are in no safetensors file here")
    return model.eval()


def stage_cache(model: Any, span: StageSpan) -> Any:
    """A fresh cache of the model's own kind in which every layer this stage skips shares the entry of an owned
    layer of the same kind (module docstring); a kind this stage does not run keeps its own, unused, entry."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", None)
    if not layers:
        return cache
    owned: dict[tuple[type, Any], Any] = {}
    for i, layer in enumerate(layers):
        if span.owns(i):
            owned.setdefault(_kind(layer), layer)
    for i, layer in enumerate(layers):
        if not span.owns(i) and _kind(layer) in owned:
            layers[i] = owned[_kind(layer)]
    return cache


def layer_bytes(cache: Any, span: StageSpan) -> list[tuple[int, int]]:
    """Per layer this stage runs, the bytes its entry of a request's cache holds (keys and values, convolution and
    recurrent states; 0-dim counters are bookkeeping) and its sliding window (0: none). The skipped layers'
    entries alias owned ones or are never written, so they are not counted."""
    out = []
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if not span.owns(i):
            continue
        storages: dict[int, int] = {}
        for value in vars(layer).values():
            for tensor in _tensors(value):
                if tensor.dim() and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        out.append((sum(storages.values()), int(getattr(layer, "sliding_window", 0) or 0)))
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def cache_bytes(cache: Any, span: StageSpan) -> int:
    return sum(b for b, _ in layer_bytes(cache, span))


@dataclass(frozen=True)
class CacheCost:
    """What one rank's cache of a request costs at n positions, fixed + per_token * n + windowed * min(n, window)
    (from the warmup request's sizes after its prefill and its decode step: linear-attention and SSM states and a
    full sliding window are fixed, full attention grows by per_token, a sliding layer not yet full by windowed), and
    the bytes placement reserved for that rank's caches (budget; -1: no bound)."""

    rank: int
    fixed: int
    per_token: int
    windowed: int
    window: int
    budget: int

    @classmethod
    def measured(cls, rank: int, first: tuple[int, list[tuple[int, int]]], second: tuple[int, list[tuple[int, int]]],
                 budget: int | None) -> CacheCost:
        """From (positions, layer_bytes) after the warmup's prefill and after its decode step."""
        (t1, layers1), (t2, layers2) = first, second
        fixed = per_token = windowed = window = 0
        for (b1, w), (b2, _) in zip(layers1, layers2, strict=True):
            # one sample (the warmup ended at its first token): every byte counted as growing, which over-counts
            grows = max(0, b2 - b1) // (t2 - t1) if t2 > t1 else b1 // max(1, t1)
            fixed += max(0, b1 - grows * t1)
            if w:
                windowed, window = windowed + grows, max(window, w)
            else:
                per_token += grows
        return cls(rank, fixed, per_token, windowed, window, -1 if budget is None else budget)

    def bytes_for(self, positions: int) -> int:
        return self.fixed + self.per_token * positions + self.windowed * min(positions, self.window)

    def holds(self, running: list[int], need: int) -> bool:
        """Whether caches of these sizes (the running requests' and one more's, in positions) fit the budget."""
        return self.budget < 0 or sum(self.bytes_for(n) for n in (*running, need)) <= self.budget


def _kind(layer: Any) -> tuple[type, Any]:
    return type(layer), getattr(layer, "sliding_window", None)


def layer_count(model_dir: Path) -> int:
    """The checkpoint's decoder layers (num_hidden_layers, on its text config for a multimodal wrapper)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    return int(config.get_text_config(decoder=True).num_hidden_layers)


def hidden_size(model: Any) -> int:
    return int(model.config.get_text_config(decoder=True).hidden_size)


def forward_stage(model: Any, span: StageSpan, ids: torch.Tensor, hidden: torch.Tensor | None, cache: Any,
                  start: int) -> torch.Tensor:
    """This stage's part of one request's forward over `ids` at positions [start, start + len), from the previous
    stage's hidden states on any stage but the first: hidden states for the next stage, or, on the last, the last
    position's logits (float32, one row)."""
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    inputs: dict[str, Any] = {"input_ids": ids} if hidden is None else {"inputs_embeds": hidden}
    decoder = decoder_of(model)
    if span.last:
        out = model(**inputs, cache=cache, use_cache=True, position_ids=positions, logits_to_keep=1)
        return out.logits[0, -1:].float()
    return decoder(**inputs, cache=cache, use_cache=True, position_ids=positions).last_hidden_state
