"""The built-in demo embedding model, generated locally so embeddings work offline.

`skulk/tiny-random-embed` is a sentence-transformers directory laid out like `all-MiniLM-L6-v2`: a BertModel
(config.json, model.safetensors) of 384 dimensions with random weights from a fixed seed, a WordPiece
tokenizer (tokenizer.json: BERT's normaliser and pre-tokenizer, [CLS] … [SEP]) whose vocabulary is single
characters and their `##` continuations, so it needs no training data, and `modules.json` +
`1_Pooling/config.json` (mean pooling) + `2_Normalize`. Its vectors carry no meaning, but they are unit
length, deterministic, and made by the same loader, tokenizer and pooling as a downloaded model. The files are
byte-for-byte reproducible, like the demo chat model's.
"""

from __future__ import annotations

import functools
import json
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from skulk.types.ids import ModelId
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

if TYPE_CHECKING:  # torch loads only to generate weights: the node imports this module's ids
    import torch

EMBED_MODEL_ID = ModelId("skulk/tiny-random-embed")
EMBED_SEED = 2
EMBED_SHAPE: dict[str, int] = {"hidden_size": 384, "n_layers": 2, "n_heads": 6, "intermediate_size": 1536}
"""all-MiniLM-L6-v2's width, heads and MLP; two layers instead of six keep it small for CPU CI (~15 MB)."""
MAX_POSITIONS = 512
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_CHARS = string.ascii_lowercase + string.digits + string.punctuation
_WEIGHT_STD = 0.02


def wordpiece_vocab() -> dict[str, int]:
    """Specials first (so [PAD] is 0, as in BERT), then every character and its word-continuation form."""
    tokens = [*SPECIALS, *_CHARS, *(f"##{c}" for c in _CHARS)]
    return {token: i for i, token in enumerate(tokens)}


def wordpiece_tokenizer() -> Tokenizer:
    """A BERT uncased tokenizer over the character vocabulary: text outside it becomes [UNK]."""
    vocab = wordpiece_vocab()
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)  # type: ignore[assignment]
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # type: ignore[assignment]
    tok.post_processor = processors.TemplateProcessing(  # type: ignore[assignment]
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece(prefix="##")  # type: ignore[assignment]
    return tok


def generate_random_bert(path: Path, *, hidden_size: int, n_layers: int, n_heads: int, intermediate_size: int,
                         seed: int) -> Path:
    """Write a random-weight sentence encoder (BertModel + WordPiece + mean pooling + Normalize) into path."""
    if hidden_size % n_heads:
        raise ValueError("hidden_size must divide into n_heads")
    path.mkdir(parents=True, exist_ok=True)
    config = _bert_config(hidden_size, n_layers, n_heads, intermediate_size)
    _write_json(path / "config.json", config)
    from safetensors.torch import save_file

    save_file(_random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "tokenizer.json", json.loads(wordpiece_tokenizer().to_str()))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "model_max_length": MAX_POSITIONS,
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]",
    })
    _write_json(path / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": MAX_POSITIONS, "do_lower_case": False})
    (path / "1_Pooling").mkdir(exist_ok=True)
    _write_json(path / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    })
    (path / "2_Normalize").mkdir(exist_ok=True)
    return path


@functools.cache
def embed_card() -> ModelCard:
    """The demo embedding model's card; its storage size is measured from a real generation."""
    with tempfile.TemporaryDirectory() as tmp:
        path = generate_random_bert(Path(tmp), seed=EMBED_SEED, **EMBED_SHAPE)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return ModelCard(
        model_id=EMBED_MODEL_ID,
        family="bert",
        n_layers=EMBED_SHAPE["n_layers"],
        hidden_size=EMBED_SHAPE["hidden_size"],
        num_attention_heads=EMBED_SHAPE["n_heads"],
        num_key_value_heads=EMBED_SHAPE["n_heads"],
        storage_size=Memory.from_bytes(size),
        dtype="float32",
        context_length=MAX_POSITIONS,
        vocab_size=len(wordpiece_vocab()),
        supports_tensor=False,
        builtin=True,
        tasks=["TextEmbedding"],
    )


def _bert_config(hidden_size: int, n_layers: int, n_heads: int, intermediate_size: int) -> dict[str, Any]:
    return {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden_size,
        "initializer_range": _WEIGHT_STD,
        "intermediate_size": intermediate_size,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": "bert",
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
        "type_vocab_size": 2,
        "use_cache": True,
        "vocab_size": len(wordpiece_vocab()),
    }


def bert_weight_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """BertModel's tensors by HF name (no pooler: a sentence encoder does not use it), in a fixed order."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("embeddings.word_embeddings.weight", (config["vocab_size"], h)),
        ("embeddings.position_embeddings.weight", (config["max_position_embeddings"], h)),
        ("embeddings.token_type_embeddings.weight", (config["type_vocab_size"], h)),
        ("embeddings.LayerNorm.weight", (h,)), ("embeddings.LayerNorm.bias", (h,)),
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for proj in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes += [(f"{p}.{proj}.weight", (h, h)), (f"{p}.{proj}.bias", (h,))]
        shapes += [
            (f"{p}.attention.output.LayerNorm.weight", (h,)), (f"{p}.attention.output.LayerNorm.bias", (h,)),
            (f"{p}.intermediate.dense.weight", (inter, h)), (f"{p}.intermediate.dense.bias", (inter,)),
            (f"{p}.output.dense.weight", (h, inter)), (f"{p}.output.dense.bias", (h,)),
            (f"{p}.output.LayerNorm.weight", (h,)), (f"{p}.output.LayerNorm.bias", (h,)),
        ]
    return shapes


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Drawn in a fixed order from one seeded CPU generator; LayerNorms are ones and zeros, as at HF init."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in bert_weight_shapes(config):
        if "LayerNorm" in name:
            weights[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(_WEIGHT_STD)
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
