"""Counting a prompt's tokens on the API node, for APIs that ask without generating (count_tokens).

The tokenizer lives with the model's files: a node that holds them (its store copy, a staged copy, or a built-in
model it generated) counts exactly, with the model's own chat template; any other node answers 503 naming a node
that can. Loaded once per model, off the event loop."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skulk.api.services import ApiServices
from skulk.engines.errors import PromptRejected
from skulk.runner.admission import context_refusal
from skulk.state.queries import card_of, served_context
from skulk.store.files import model_dir_name
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.errors import ApiError, ErrorCode

if TYPE_CHECKING:
    from skulk.engines.torch.tokenizer import ChatTokenizer


def local_model_dir(node: ApiServices, model_id: str) -> Path | None:
    settings = node.settings
    try:
        name = model_dir_name(model_id)
    except ValueError as exc:  # "..", an absolute path: never joined onto a directory
        raise ApiError(ErrorCode.invalid_request, f"{exc}; GET /models lists the model ids") from exc
    staging = settings.staging_for(node.node_id).node_cache_path
    for root in (settings.models_dir, settings.store_path, staging):
        if root is not None and (root / name / "tokenizer_config.json").exists():
            return root / name
    return None


@lru_cache(maxsize=8)
def _tokenizer(model_dir: Path) -> ChatTokenizer:
    from skulk.engines.torch.tokenizer import ChatTokenizer

    return ChatTokenizer(model_dir)


async def count_chat_tokens(node: ApiServices, model_id: str, messages: list[ChatMessage],
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> int:
    """The prompt's tokens as the runner will render them: the chat template with the tools offered and the
    request's template variables, each image its whole placeholder run (ChatTokenizer.render_chat)."""
    model_dir = local_model_dir(node, model_id)
    if model_dir is None:
        holders = sorted({n for i in node.state.instances.values() if i.model_id == model_id
                          for n in i.shard_assignments.node_to_runner})
        raise ApiError(ErrorCode.tokenizer_not_local,
                       f"this node has no copy of {model_id}'s tokenizer; ask a node that serves it "
                       f"({', '.join(holders) or 'none is placed: place the model first'})")
    tokenizer = await asyncio.to_thread(_tokenizer, model_dir)
    try:
        return len(await asyncio.to_thread(tokenizer.encode_chat, messages, tools, template_kwargs))
    except PromptRejected as refused:
        raise ApiError(ErrorCode.invalid_request, str(refused)) from refused


def check_context(node: ApiServices, model_id: str, prompt_tokens: int) -> None:
    """A prompt the runners would refuse is refused here too, with their message and the advertised limit
    (state.queries.served_context), so count_tokens never answers a count the model cannot take."""
    card = card_of(node.state, model_id)
    if card is None:
        return
    refusal = context_refusal(prompt_tokens, SamplingParams(), served_context(node.state, card))
    if refusal is not None:
        raise ApiError(ErrorCode.context_length_exceeded, refusal)


async def local_tokenizer(node: ApiServices, model_id: str) -> ChatTokenizer | None:
    """The model's own tokenizer and chat template when this node holds its files (loaded once, off the loop);
    None otherwise, for callers that describe a model rather than need it (Ollama's show)."""
    model_dir = local_model_dir(node, model_id)
    return None if model_dir is None else await asyncio.to_thread(_tokenizer, model_dir)
