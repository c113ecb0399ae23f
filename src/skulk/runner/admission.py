"""Context admission: whether a request fits the model's context, decided before anything is streamed."""

from __future__ import annotations

from skulk.types.chat import SamplingParams


def admit(
    prompt_tokens: int, sampling: SamplingParams, engine_context: int, limit: int | None
) -> tuple[str | None, SamplingParams]:
    """The refusal (or None) and the sampling to run with, held to `limit` (the context the API advertised; None:
    the engine's). Under a limit below the engine's context an implicit max_tokens is clamped to the room left, so
    prompt plus generation stays within what clients were shown; an explicit one was already checked."""
    context = engine_context if limit is None else min(engine_context, limit)
    refusal = context_refusal(prompt_tokens, sampling, context)
    if refusal is None and context < engine_context and not sampling.max_tokens_explicit:
        sampling = sampling.model_copy(update={"max_tokens": min(sampling.max_tokens, context - prompt_tokens)})
    return refusal, sampling


def context_refusal(prompt_tokens: int, sampling: SamplingParams, context_length: int) -> str | None:
    """Why the request cannot be served (the 400 `context_length_exceeded` message), or None.

    As OpenAI and Skulk do: a prompt that fills the context is refused; so is an explicit max_tokens that cannot
    fit after the prompt. An omitted max_tokens is not refused: generation stops at the context end ("length").
    """
    if prompt_tokens >= context_length:
        return (
            f"This model's maximum context length is {context_length} tokens, but the prompt has "
            f"{prompt_tokens} tokens. Shorten the messages."
        )
    room = context_length - prompt_tokens
    if sampling.max_tokens_explicit and sampling.max_tokens > room:
        return (
            f"This model's maximum context length is {context_length} tokens: the prompt ({prompt_tokens} tokens) "
            f"plus max_tokens ({sampling.max_tokens}) does not fit. Lower max_tokens to at most {room} or "
            "shorten the messages."
        )
    return None
