"""Which model may do what: an embedding model only embeds, a text-generation model only generates.

Decided from the model's card on the API node before anything is sent, so a mix-up is a 400 naming the models
that can do what was asked (placed ones first, as they answer now) instead of a task that fails in a runner.
"""

from __future__ import annotations

from skulk.api.services import ApiServices
from skulk.models.cards import all_cards
from skulk.state.queries import card_of
from skulk.types.errors import ApiError, ErrorCode
from skulk.types.models import ModelCard


def _cards(node: ApiServices) -> list[ModelCard]:
    return list({c.model_id: c for c in [*all_cards(), *node.state.model_cards.values()]}.values())


def _who_can(node: ApiServices, *, embeds: bool) -> str:
    """The models that can do it: placed ones first (they answer now), then the others the catalog knows."""
    placed = {i.model_id for i in node.state.instances.values()}
    able = sorted(c.model_id for c in _cards(node) if c.embeds == embeds)
    now = [m for m in able if m in placed]
    later = [m for m in able if m not in placed]
    parts = [f"placed: {', '.join(now)}" if now else "none is placed", f"known: {', '.join(later)}" if later else ""]
    return "; ".join(p for p in parts if p)


def embedding_card(node: ApiServices, model: str) -> ModelCard:
    """The card of an embedding model; 404 for an unknown model, 400 for one that generates text."""
    card = card_of(node.state, model)
    if card is None:
        raise ApiError(ErrorCode.model_not_found,
                       f"model {model} is unknown; models that embed: {_who_can(node, embeds=True)}")
    if not card.embeds:
        raise ApiError(ErrorCode.model_not_embedding,
                       f"{model} is a text-generation model and cannot embed; models that embed: "
                       f"{_who_can(node, embeds=True)}")
    return card


def refuse_embedding_model(node: ApiServices, model: str) -> None:
    """For every text API: an embedding model cannot chat (400 naming the models that can)."""
    card = card_of(node.state, model)
    if card is not None and card.embeds:
        raise ApiError(ErrorCode.model_not_chat,
                       f"{model} is an embedding model and cannot generate text; send it to POST "
                       f"/v1/embeddings. Models that generate text: {_who_can(node, embeds=False)}")


def check_dimensions(card: ModelCard, dimensions: int | None) -> None:
    if dimensions is not None and dimensions != card.hidden_size:
        raise ApiError(ErrorCode.invalid_request,
                       f"dimensions: {card.model_id} gives {card.hidden_size}-dimensional vectors and is not "
                       f"trained to be cut shorter; omit dimensions or send {card.hidden_size}")
