"""Sentence embeddings: tokenize, run the BERT encoder, pool and normalise as the model's own files say.

A sentence-transformers checkpoint describes its pipeline in `modules.json` (Transformer, then Pooling, then
optionally Normalize) with the pooling mode in `1_Pooling/config.json` (all-MiniLM-L6-v2: mean over the real
tokens; bge-small-en-v1.5: the [CLS] token), so the same code serves both and gives the vectors
sentence-transformers would. A bare encoder without those files is mean-pooled and not normalised, which is
what sentence-transformers does for one. An embedding request runs whole when it is accepted (one batched
forward per 32 inputs): there is no decode loop to interleave, so the engine never has work between steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from skulk.engines.base import TokenOut
from skulk.engines.torch.bert import BertEncoder, load_bert
from skulk.types.chat import ChatMessage, SamplingParams

PoolingMode = Literal["cls", "mean", "max", "mean_sqrt_len", "lasttoken"]
_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
}
MICRO_BATCH = 32
"""Inputs per forward: bounds activation memory for a request of many long texts."""


class EmbeddingRefused(ValueError):
    """The request cannot be embedded as sent (too long, an unknown token id); the message says what to fix.
    The runner answers it with a 400."""


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: PoolingMode
    normalize: bool


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling of a sentence-transformers directory; mean without normalisation for a bare encoder.
    ValueError for a pooling this engine does not implement or that combines several modes."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return Pooling("mean", normalize=False)
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text(encoding="utf-8"))
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: str(m.get("path", "")) for m in modules}
    unknown_modules = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown_modules:  # a Dense projection or the like: its vectors would silently differ from the model's
        raise ValueError(f"{model_dir.name}: sentence-transformers module(s) {', '.join(unknown_modules)} are not "
                         "supported (only Transformer, Pooling and Normalize)")
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return Pooling("mean", normalize)
    cfg = json.loads((model_dir / kinds["Pooling"] / "config.json").read_text(encoding="utf-8"))
    modes: list[PoolingMode] = [mode for key, mode in _POOLING_KEYS.items() if cfg.get(key)]
    unknown = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in _POOLING_KEYS]
    if unknown or len(modes) != 1:
        raise ValueError(f"{model_dir.name}: pooling {', '.join([*unknown, *modes]) or 'none'} is not supported; "
                         f"exactly one of {', '.join(_POOLING_KEYS)} is")
    return Pooling(modes[0], normalize)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """[batch, seq, hidden] and a [batch, seq] 0/1 mask → [batch, hidden], as sentence-transformers pools."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    lengths = m.sum(dim=1).clamp(min=1e-9)
    match pooling.mode:
        case "cls":
            out = hidden[:, 0]
        case "mean":
            out = (hidden * m).sum(dim=1) / lengths
        case "mean_sqrt_len":
            out = (hidden * m).sum(dim=1) / lengths.sqrt()
        case "max":
            out = hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
        case "lasttoken":
            last = mask.sum(dim=1).long() - 1
            out = hidden[torch.arange(hidden.shape[0]), last]
    return F.normalize(out, p=2, dim=-1) if pooling.normalize else out


class EmbeddingEngine:
    """A sentence encoder behind the runner's engine interface. Chat calls are refused with a message that
    says so; `embed` is what the runner calls for an embedding task."""

    def __init__(self, model_dir: Path, *, device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.device = device
        self.model: BertEncoder = load_bert(model_dir, device=device)
        self.pooling = read_pooling(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.no_truncation()  # too long is refused, never cut silently
        self.tokenizer.no_padding()
        self.context_length = self.model.args.max_position_embeddings
        self.dimension = self.model.args.hidden_size
        self.vocab_size = self.model.args.vocab_size
        self.pad_id = self._pad_id()

    def _pad_id(self) -> int:
        cfg_file = self.model_dir / "tokenizer_config.json"
        pad = json.loads(cfg_file.read_text(encoding="utf-8")).get("pad_token") if cfg_file.is_file() else None
        found = self.tokenizer.token_to_id(pad) if isinstance(pad, str) else None
        return found if found is not None else 0  # padding is masked out: any id in range would do

    def tokenize(self, inputs: list[str] | list[list[int]], *, truncate: bool = False) -> list[list[int]]:
        """Texts through the model's tokenizer (its [CLS]/[SEP] included); token-id lists as they are, being
        the model's own ids. An input longer than the model's positions is cut when truncate is set (the
        tokenizer keeps its special tokens, as sentence-transformers does), else refused (EmbeddingRefused),
        as is an id outside the vocabulary."""
        if inputs and isinstance(inputs[0], str):
            rows = [e.ids for e in self._encode([str(t) for t in inputs], truncate)]
        else:
            rows = [list(map(int, r))[:self.context_length if truncate else None] for r in inputs]  # type: ignore[arg-type]
        for i, row in enumerate(rows):
            if not row:
                raise EmbeddingRefused(f"input {i} has no tokens; send a non-empty text")
            if len(row) > self.context_length:
                raise EmbeddingRefused(
                    f"input {i} is {len(row)} tokens; {self.model_dir.name} takes at most {self.context_length} "
                    "tokens per input (max_position_embeddings): shorten or split it"
                )
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbeddingRefused(f"input {i} has token id {bad}; the model's ids are 0…{self.vocab_size - 1}")
        return rows

    def _encode(self, texts: list[str], truncate: bool) -> list[Any]:
        if not truncate:
            return self.tokenizer.encode_batch(texts)
        self.tokenizer.enable_truncation(self.context_length)
        try:
            return self.tokenizer.encode_batch(texts)
        finally:
            self.tokenizer.no_truncation()

    @torch.inference_mode()
    def embed(self, inputs: list[str] | list[list[int]], *, truncate: bool = False) -> tuple[torch.Tensor, int]:
        """[len(inputs), dimension] float32 vectors in input order, and the tokens they took in all."""
        rows = self.tokenize(inputs, truncate=truncate)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # similar lengths pad less
        out = torch.empty(len(rows), self.dimension, dtype=torch.float32)
        for start in range(0, len(order), MICRO_BATCH):
            batch = order[start:start + MICRO_BATCH]
            out[batch] = self._forward([rows[i] for i in batch]).float().cpu()
        return out, sum(len(r) for r in rows)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return pool(self.model(ids, mask), mask, self.pooling)

    def warmup(self) -> None:
        self.embed(["warm up"])

    # The runner's engine interface: an embedding model has no chat, and no work between steps.

    def encode_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        raise ValueError(f"{self.model_dir.name} is an embedding model: it cannot chat; use POST /v1/embeddings")

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        raise ValueError(f"{self.model_dir.name} is an embedding model: it cannot generate text")

    def cancel(self, request_id: str) -> None:
        """Nothing to drop: an embedding request finishes inside the call that accepted it."""

    def has_work(self) -> bool:
        return False

    def step(self) -> list[TokenOut]:
        return []
