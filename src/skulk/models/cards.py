"""The model catalogue: one JSON card per model under models/cards/, loaded once.

Cards are data, not code, so adding a model is a reviewed JSON file with the numbers from its config.json
(layers, hidden size, heads) and the bytes its weights take on disk, which placement uses to fit shards
into node memory.
"""

from __future__ import annotations

import functools
import json
import logging
from importlib import resources
from pathlib import Path

from skulk import file_format
from skulk.store.files import model_dir_name
from skulk.types import versions
from skulk.types.memory import Memory
from skulk.types.models import KvCacheBits, ModelCard, QuantizeAtLoad

log = logging.getLogger("skulk.models")

_CARDS_PACKAGE = "skulk.models"
_CARDS_DIR = "cards"


_custom: dict[str, ModelCard] = {}
"""Cards added at run time (POST /models/add), kept as JSON under the node's home and loaded at start."""


def get_card(model_id: str) -> ModelCard | None:
    """The card for model_id, or None when the catalogue does not know it."""
    return _cards_by_id().get(model_id) or _custom.get(model_id)


def all_cards() -> list[ModelCard]:
    """Every card, packaged and custom, sorted by model id so listings are stable."""
    return sorted({**_custom, **_cards_by_id()}.values(), key=lambda c: c.model_id)


def is_custom(model_id: str) -> bool:
    return model_id in _custom and model_id not in _cards_by_id()


def load_custom_cards(folder: Path) -> None:
    """The custom cards a node kept under folder; an unreadable one is skipped with a warning, one of an older
    format migrated (a backup kept beside it), one of a newer format refused and left as it is."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.glob("*.json")):
        try:
            card = _read_card(entry)
        except (ValueError, file_format.RefusedFile) as exc:
            log.warning("ignoring custom model card %s: %s", entry, exc)
            continue
        _custom[card.model_id] = card


def _read_card(entry: Path) -> ModelCard:
    data = json.loads(file_format.bring_up_to_date(entry, entry.read_bytes()))
    if isinstance(data, dict):
        data.pop(versions.FILE_FIELD, None)
    return ModelCard.model_validate(data)


_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_QUANT_BYTES = {"int4": 0.5 + 4 / 64, "int8": 1.0 + 2 / 256}
"""Bytes per weight after quantizing at load: int4 in groups of 64 with a bf16 scale and zero each; int8 with
one bf16 scale per row (rows are at least a few hundred wide)."""


def with_quantization(card: ModelCard, kind: QuantizeAtLoad | None) -> ModelCard:
    """card as it will run quantized at load. The memory estimate never runs short: projections shrink by the
    byte ratio, the embedding stays float, and a tied lm_head adds a quantized copy of it (a card that does not
    know its vocabulary gets a quarter more). ValueError when the checkpoint is quantized already."""
    if kind is None:
        return card
    if card.quantization != "none":
        raise ValueError(f"{card.model_id} is already quantized ({card.quantization}-bit); place it without "
                         "quantization")
    ratio = _QUANT_BYTES[kind] / _FLOAT_BYTES[card.dtype]
    stored = card.storage_size.in_bytes
    if card.vocab_size is None:  # the embedding's share is unknown: leave a quarter more room
        size = stored * ratio * 1.25
    else:
        embed = card.vocab_size * card.hidden_size
        size = stored * ratio + embed * (_FLOAT_BYTES[card.dtype] * (1 - ratio) + _QUANT_BYTES[kind])
    return card.model_copy(update={"quantize_at_load": kind, "storage_size": Memory.from_bytes(int(size))})


def with_kv_bits(card: ModelCard, bits: KvCacheBits | None) -> ModelCard:
    """card as it will run with its KV cache at `bits` (None: as the card says, 16 unless it sets its own), the
    setting riding on the card to the runners as quantize_at_load does."""
    if bits is None or bits == (card.kv_cache_bits or 16):
        return card
    return card.model_copy(update={"kv_cache_bits": bits})


def know_card(card: ModelCard) -> None:
    """A custom card another node added (it reached us through state): list and place it here too."""
    if card.model_id not in _cards_by_id():
        _custom[card.model_id] = card


def add_custom_card(folder: Path, card: ModelCard) -> None:
    """Keep card under folder (written whole, then renamed) and list it from now on."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{model_dir_name(card.model_id)}.json"
    tmp = target.with_suffix(".tmp")
    stamped = file_format.stamped(card.model_dump(mode="json", by_alias=True))
    tmp.write_text(json.dumps(stamped, indent=2), encoding="utf-8")
    tmp.replace(target)
    _custom[card.model_id] = card


@functools.cache
def _cards_by_id() -> dict[str, ModelCard]:
    cards: dict[str, ModelCard] = {}
    folder = resources.files(_CARDS_PACKAGE).joinpath(_CARDS_DIR)
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        card = ModelCard.model_validate_json(entry.read_text(encoding="utf-8"))
        if card.model_id in cards:
            raise ValueError(f"duplicate model card for {card.model_id} in {entry.name}")
        cards[card.model_id] = card
    return cards
