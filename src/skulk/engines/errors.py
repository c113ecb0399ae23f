"""Errors engines raise to their callers, shared by every engine so runners can handle them uniformly."""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """The prompt does not fit the engine's context window; the request is rejected before any compute."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens but the context length is {context_length} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class PromptRejected(ValueError):
    """The model's chat template refused the conversation with its own message (Gemma's and Mistral's templates
    require alternating user/assistant roles, Mistral's 9-character tool call ids): the client's to fix, so the
    request ends with a 400 carrying that message, and nothing was computed."""


def check_prompt(prompt_ids: list[int], context_length: int) -> None:
    """What every engine refuses before queueing a prompt: an empty one, or one longer than its context."""
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    if len(prompt_ids) > context_length:
        raise ContextLengthExceeded(len(prompt_ids), context_length)
