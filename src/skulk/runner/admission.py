"""Context admission: whether a request fits the model's context, decided before anything is streamed."""

from __future__ import annotations

from skulk.types.chat import SamplingParams


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
