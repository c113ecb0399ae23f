"""A model's reasoning kept apart from its answer: which format a chat template thinks in, and an incremental
splitter of the streamed text into reasoning and content.

Families: `<think>` … `</think>` (Qwen3, DeepSeek-R1 / V3.1, GLM-4.5+, MiniMax-M2, Kimi-K2-Thinking). Some templates
open the block in the prompt (DeepSeek-R1's and Qwen3-thinking-2507's end it with `<think>\\n`): the generation then
starts inside the reasoning and the model writes only `</think>`. That is decided from the rendered prompt's tail,
on the runner (which renders the template); the split runs on the API node, once for every API (api/generation.py).
gpt-oss's harmony channels: a template that writes `<|channel|>` gets the mode "harmony", split by
engines/harmony.py (`splitter_for` makes either splitter).

A reasoning budget (Anthropic's `thinking.budget_tokens`) is kept on the rank that samples (`ReasoningBudget`): it
counts the reply's reasoning tokens as the API node does (`ReasoningTally`, one counting for both), and when the
next tokens would take the reasoning past the budget it names the tokens of the family's close (`</think>`, or
harmony's end of the analysis message and the final channel's header) that the engine then forces, so the model
leaves its thinking and answers, within max_tokens.

Pure: no I/O; the splitter is fed text pieces as they are detokenized and holds back nothing longer than what could
still be the start of a tag (or whitespace that may turn out to surround one)."""

from __future__ import annotations

from typing import Literal

from skulk.engines.harmony import HarmonySplitter

ReasoningMode = Literal["think", "think_open", "harmony"]
"""think: the template uses `<think>` blocks and the reply starts as content (the model may open a block first);
think_open: the prompt opened the block, so the reply starts inside the reasoning; harmony: gpt-oss's channels."""
ReasoningOverride = Literal["think", "harmony", "none"]
"""A card's `reasoning_parser`: force the `<think>` or harmony splitter on, or off (None: decided from the
template)."""

OPEN, CLOSE = "<think>", "</think>"
HARMONY_MARK = "<|channel|>"
CLOSE_TEXT: dict[ReasoningMode, tuple[str, str]] = {
    "think": (f"\n{CLOSE}", "\n\n"), "think_open": (f"\n{CLOSE}", "\n\n"),
    "harmony": ("<|end|>", "<|start|>assistant<|channel|>final<|message|>"),
}
"""What a reasoning budget forces when it is spent, as the family's templates write it (Qwen3's
`\n</think>\n\n`; harmony: the analysis message ended, then the final answer's header): (the part counted as
reasoning, the rest, which opens the answer)."""
HARMONY_TO_CALL = ("<|end|>", "<|start|>assistant")
"""What a budget forces in a harmony reply held to a forced call (engines/constrained.py lets one analysis message
through before it): the analysis ended and the next message's start; the call's own header is the grammar's."""


def reasoning_mode(
    template: str | None, prompt_tail: str, override: ReasoningOverride | None = None
) -> ReasoningMode | None:
    """How this reply's reasoning is split (None: not at all). `template`: the chat template's text; `prompt_tail`:
    the end of the rendered prompt, which says whether the block is already open (thinking turned off the
    template's way, e.g. Qwen3's `<think>\\n\\n</think>\\n\\n`, ends in a closed block: the reply is content)."""
    if override == "none":
        return None
    if override == "harmony" or (override is None and template and HARMONY_MARK in template):
        return "harmony"
    if override is None and (not template or (OPEN not in template and CLOSE not in template)):
        return None
    tail = prompt_tail.rstrip()
    return "think_open" if tail.endswith(OPEN) else "think"


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a beginning of tag (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


class ReasoningSplitter:
    """Text pieces in, (reasoning, content) deltas out. One reasoning block, at the start of the reply: an open
    tag later in the content is content. A reply that ends inside the block is all reasoning. Whitespace next to
    the tags (the templates' `\\n` after `<think>`, before `</think>`, and `\\n\\n` after it) is dropped."""

    def __init__(self, mode: ReasoningMode) -> None:
        self.state: Literal["start", "reasoning", "after", "content"] = "start"
        self.opened = mode == "think_open"
        """Whether a block is open (or, at the start, would be): the reply starts in reasoning."""
        self.held = ""
        self.reasoning_started = False

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.opened)

    def push(self, text: str) -> tuple[str, str]:
        if self.state == "content":
            return "", text  # the common case once the reasoning is over: no copying, no search
        buffer, self.held = self.held + text, ""
        if self.state == "start":
            return self._start(buffer)
        if self.state == "reasoning":
            return self._reasoning(buffer)
        return self._after(buffer)

    def _start(self, buffer: str) -> tuple[str, str]:
        head = buffer.lstrip()
        if head.startswith(OPEN):
            self.state = "reasoning"
            return self._reasoning(head[len(OPEN):])
        if OPEN.startswith(head):  # empty, or a tag begun
            self.held = buffer
            return "", ""
        if self.opened:
            self.state = "reasoning"
            return self._reasoning(head)
        self.state = "content"
        return "", buffer

    def _reasoning(self, buffer: str) -> tuple[str, str]:
        if not self.reasoning_started:
            buffer = buffer.lstrip()
            if not buffer:
                return "", ""
            self.reasoning_started = True
        at = buffer.find(CLOSE)
        if at >= 0:
            self.state = "after"
            reasoning, content = buffer[:at].rstrip(), self._after(buffer[at + len(CLOSE):])[1]
            return reasoning, content
        cut = len(buffer) - _tag_prefix(buffer, CLOSE)
        cut -= _trailing_space(buffer[:cut])
        self.held = buffer[cut:]
        return buffer[:cut], ""

    def _after(self, buffer: str) -> tuple[str, str]:
        content = buffer.lstrip()
        if content:
            self.state = "content"
        return "", content

    def finish(self) -> tuple[str, str]:
        """What is still held when the reply ends: a tag begun but never finished is text of its side."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.opened):
            return held.rstrip() if self.reasoning_started else held.strip(), ""
        if self.state == "start":
            return "", held
        return "", ""


def splitter_for(mode: ReasoningMode) -> ReasoningSplitter | HarmonySplitter:
    """The splitter of a reply's reasoning mode (the runner's first chunk says which)."""
    return HarmonySplitter() if mode == "harmony" else ReasoningSplitter(mode)


class ReasoningTally:
    """A splitter that also counts the tokens spent inside the reasoning (its tags included), one `push` per
    generated token: the API node's count (api/generation.py) and a budget's (`ReasoningBudget`) are this one. A
    token that may be the start of the open tag is counted once the block opens."""

    def __init__(self, mode: ReasoningMode) -> None:
        self.splitter = splitter_for(mode)
        self.tokens = 0
        self._pending = 0

    def push(self, text: str) -> tuple[str, str]:
        """One token's text in, its (reasoning, content) out."""
        splitter = self.splitter
        was, undecided = splitter.in_reasoning, splitter.state == "start"
        reasoning, content = splitter.push(text) if text else ("", "")
        if splitter.state == "start":
            self._pending += 1
        elif was or splitter.in_reasoning or (undecided and splitter.state == "after"):
            self.tokens += 1 + self._pending
            self._pending = 0
        elif undecided:
            self._pending = 0
        return reasoning, content


class ReasoningBudget:
    """One reply's cap on its reasoning tokens, where it is sampled. `after` each token: the tokens to force
    next, the close (`close_ids`, CLOSE_TEXT tokenized, of which the first `cost` count as reasoning), once the
    reasoning and the close would reach the budget, so the reasoning, tags included, takes at most `budget` tokens
    (more only where the block's open and close alone take more)."""

    def __init__(self, mode: ReasoningMode, budget: int, close_ids: list[int], cost: int) -> None:
        self.tally = ReasoningTally(mode)
        self.budget = budget
        self.close_ids = close_ids
        self.cost = cost
        self.spent = False

    def after(self, text: str) -> list[int]:
        """The text of the token just generated; the tokens to force next ([] but once)."""
        self.tally.push(text)
        if self.spent or not self.tally.splitter.in_reasoning:
            return []
        if self.tally.tokens + self.cost < self.budget:
            return []
        self.spent = True
        return list(self.close_ids)
