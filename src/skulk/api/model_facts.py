"""What the client APIs say about a model beyond its card: where this node keeps its files, when they changed,
how many parameters it has and a digest that names it. Ollama's /api/tags, /api/show and /api/ps, OpenAI's and
Anthropic's model lists all read them here, so the three never disagree.

- `modified` is the newest mtime of the model's files on this node (its store copy, staged copy, or the generated
  built-in), never "now"; a node without a copy answers the time its custom card was written, else the epoch.
- `parameter_count` sums the tensor shapes in the safetensors headers (8 bytes and a JSON header per file, no
  weights read); a GGUF copy counts config.json's shapes; without files on this node it is estimated from the
  card's size and dtype.
- `digest` is `sha256:` of the card's JSON, as Ollama's is of its manifest: the same on every node, and it
  changes when the model does."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime
from pathlib import Path

from skulk.api.services import ApiServices
from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import read_config, safetensors_header
from skulk.models.cards import all_cards
from skulk.state.queries import card_of
from skulk.store.files import model_dir_name
from skulk.types.models import ModelCard

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
BYTES_PER_PARAMETER = {"int4": 0.5, "int8": 1.0, "4": 0.5, "8": 1.0}
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def served_cards(node: ApiServices) -> list[ModelCard]:
    """The models the cluster can answer for now: those with a placed instance, by id."""
    placed = {i.model_id for i in node.state.instances.values()}
    cards = {c.model_id: c for c in [*all_cards(), *node.state.model_cards.values()]}
    return [cards[m] for m in sorted(placed) if m in cards]


def not_served(node: ApiServices, model_id: str) -> str:
    """The 404's message for a model without an instance: how to place it, or how to add it to the catalog."""
    if card_of(node.state, model_id) is None:
        return (f"model {model_id} is not known: GET /models lists the catalog, and POST /models/add "
                f'{{"model_id": "org/name"}} adds a Hugging Face model to it')
    return (f"model {model_id} is not placed: place it with POST /place_instance "
            f'{{"model_id": "{model_id}"}} (or POST /meta_instance to keep it placed, or the dashboard\'s Placing '
            "page); GET /v1/models lists the models being served")


def model_dir(node: ApiServices, card: ModelCard) -> Path | None:
    """This node's copy of the model's files, if it has one."""
    name = model_dir_name(card.model_id)
    if card.builtin:
        candidates = [node.settings.models_dir / name]
    else:
        candidates = [node.files.store_dir(card.model_id), node.files.staging_root / name]
    return next((d for d in candidates if d.is_dir() and any(d.iterdir())), None)


def modified(node: ApiServices, card: ModelCard) -> datetime:
    where = model_dir(node, card)
    times = [p.stat().st_mtime for p in where.iterdir() if p.is_file()] if where is not None else []
    if not times and not card.builtin:
        path = node.settings.home / "cards" / f"{model_dir_name(card.model_id)}.json"  # cards.add_custom_card
        times = [path.stat().st_mtime] if path.is_file() else []
    return datetime.fromtimestamp(max(times), UTC) if times else EPOCH


def rfc3339(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def digest(card: ModelCard) -> str:
    return "sha256:" + hashlib.sha256(card.model_dump_json().encode()).hexdigest()


def parameter_count(node: ApiServices, card: ModelCard) -> int:
    """Exact from safetensors headers; from config.json's shapes for a GGUF copy (whose blocks hide them);
    estimated from the card's size without either."""
    where = model_dir(node, card)
    counted = safetensors_parameters(sorted(where.glob("*.safetensors"))) if where is not None else 0
    if not counted and where is not None and (where / "config.json").is_file():
        counted = config_parameters(where / "config.json")
    if counted:
        return counted
    per = BYTES_PER_PARAMETER.get(card.quantization, DTYPE_BYTES.get(card.dtype, 2.0))
    return int(card.storage_size.in_bytes / per)


def config_parameters(path: Path) -> int:
    """A decoder's weights from its config: embeddings, per layer attention (q, k, v, o), the MLP (or its
    experts and router) and two norms, the final norm, and an untied head (0 when the config is unreadable)."""
    try:
        config = read_config(path)
        c = config.get("text_config") or config
        hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        experts = int(c.get("num_experts") or 0)
        inner = int(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts else \
            int(c["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = experts * 3 * hidden * inner + hidden * experts if experts else 3 * hidden * inner
    head = 0 if c.get("tie_word_embeddings", config.get("tie_word_embeddings", False)) else vocab * hidden
    return vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden + head


def safetensors_parameters(paths: list[Path]) -> int:
    """The elements of every tensor the headers name (0 when a header cannot be read)."""
    total = 0
    for path in paths:
        try:
            header = safetensors_header(path)  # every shape checked against the file (skulk.formats)
        except InvalidModelFile:
            return 0
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def parameter_size(count: int) -> str:
    """Ollama's short form: 135M, 1.5B, 70B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}".rstrip("0").rstrip(".") + suffix if value < 10 else f"{round(value)}{suffix}"
    return str(count)
