"""A BERT-family encoder in plain torch, loaded from a Hugging Face checkpoint (config.json + safetensors).

Sentence encoders such as `sentence-transformers/all-MiniLM-L6-v2` and `BAAI/bge-small-en-v1.5` are BertModels:
embeddings (word + absolute position + token type, LayerNorm), then post-LayerNorm transformer layers with
biased projections and GELU. The checkpoint's tensor names are HF's (`embeddings.word_embeddings.weight`,
`encoder.layer.N.attention.self.query.weight`, …), with or without the `bert.` prefix a task head adds; the
pooler and any head are not used by a sentence encoder and are not loaded. The module is written here, not
taken from transformers, so the runner needs nothing but torch and safetensors, like the decoder engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from skulk.formats.checkpoint import read_config, safetensors_header

ENCODER_MODEL_TYPES = ("bert",)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_PREFIXES = ("", "bert.", "model.")
_SKIPPED = ("pooler.", "cls.", "classifier.", "embeddings.position_ids")
"""Tensors a sentence encoder does not use: the next-sentence pooler, pre-training and classification heads,
and the position-ids buffer older checkpoints saved."""


@dataclass(frozen=True, slots=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BertArgs:
        """ValueError for what this encoder cannot run (another architecture, relative positions, an
        activation it does not know), so a model is refused at load, not half-run."""
        model_type = str(cfg.get("model_type", ""))
        if model_type not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model_type {model_type or '(none)'} is not a BERT encoder "
                             f"({', '.join(ENCODER_MODEL_TYPES)})")
        position = cfg.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"position_embedding_type {position} is not supported (only absolute)")
        act = str(cfg.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act} is not supported ({', '.join(_ACTIVATIONS)})")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError("hidden_size must divide into num_attention_heads")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
        )


class BertEmbeddings(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        # a single segment: token type 0 everywhere, as sentence encoders are run
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.heads = a.num_attention_heads
        self.query = nn.Linear(a.hidden_size, a.hidden_size)
        self.key = nn.Linear(a.hidden_size, a.hidden_size)
        self.value = nn.Linear(a.hidden_size, a.hidden_size)


class _DenseNorm(nn.Module):
    """HF's BertSelfOutput / BertOutput: project, add the residual, LayerNorm (post-norm)."""

    def __init__(self, d_in: int, a: BertArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.self = _SelfAttention(a)  # HF's tensor names say attention.self.query
        self.output = _DenseNorm(a.hidden_size, a)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        att = self.self
        b, n, d = x.shape
        h = att.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, h, d // h).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(att.query(x)), split(att.key(x)), split(att.value(x)),
                                             attn_mask=mask)
        return self.output(out.transpose(1, 2).reshape(b, n, d), x)


class _Intermediate(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = _ACTIVATIONS[a.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.attention = _Attention(a)
        self.intermediate = _Intermediate(a)
        self.output = _DenseNorm(a.intermediate_size, a)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(a) for _ in range(a.num_hidden_layers))


class BertEncoder(nn.Module):
    """Token ids and an attention mask (1 = token, 0 = padding) → the last hidden state, [batch, seq, hidden]."""

    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = BertEmbeddings(args)
        self.encoder = _Encoder(args)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        # padded keys get -inf-like scores; every row has at least one real token, so no row is all masked
        bias = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(attention_mask == 0, torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x


def load_bert(model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> BertEncoder:
    """The encoder of model_dir with every weight it needs; ValueError naming what is missing or unsupported."""
    args = BertArgs.from_config(read_config(model_dir / "config.json"))
    with torch.device("meta"):
        model = BertEncoder(args)
    wanted = dict(model.state_dict())
    found = _read_weights(model_dir, set(wanted))
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise ValueError(f"{model_dir.name}: the checkpoint lacks {len(missing)} encoder tensor(s), e.g. {missing[0]}")
    for name, tensor in found.items():
        if tensor.shape != wanted[name].shape:
            raise ValueError(f"{model_dir.name}: {name} has shape {tuple(tensor.shape)}, config.json says "
                             f"{tuple(wanted[name].shape)}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in found.items()}, assign=True)
    return model.eval()


def _read_weights(model_dir: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Every wanted tensor from the directory's safetensors files, under our name (prefix dropped; the
    LayerNorm `gamma`/`beta` of old TF-converted checkpoints renamed)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir.name}: no .safetensors weights")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        safetensors_header(file)  # bounds first (skulk.formats.checkpoint)
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = _our_name(key)
                if name in wanted:
                    found[name] = f.get_tensor(key)
    return found


def _our_name(key: str) -> str | None:
    for prefix in _PREFIXES:
        if prefix and not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name.startswith(_SKIPPED):
            return None
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith(("embeddings.", "encoder.")):
            return name
    return None

