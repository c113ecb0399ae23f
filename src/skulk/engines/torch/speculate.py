"""Speculative decoding by prompt lookup: drafts are n-grams copied from the request's own tokens, no second model.

A reply that repeats its prompt (code edits, summaries quoting their source, structured output echoing keys) has
long runs where the next tokens are the ones that followed the same few tokens earlier. The engine proposes
them, runs the request's last token and the draft as one chunk (one read of the weights for up to MAX_DRAFT + 1
tokens, which on a memory-bound decode costs little more than one), and keeps the draft's longest prefix that
greedy decoding would have produced itself, plus the model's own next token: output is token for token what
plain greedy decoding gives. The pure parts live here; local_step.Speculator runs the step.

A sampled request keeps its drafts by the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023;
`verify_sampled`): its tokens then follow exactly the distribution plain sampling draws from (temperature,
top-k and top-p applied to the target's and the draft's logits alike), though not the same tokens for a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling import draw

MAX_DRAFT = 8  # tokens proposed per request and step
NGRAM = (3, 2)  # the n-gram lengths looked up, longest first (1 proposes too much noise to pay)
GIVE_UP_AFTER = 24
"""Drafted tokens after which a request whose acceptance is below GIVE_UP_RATE stops drafting (its rejected drafts
would only slow it down)."""
GIVE_UP_RATE = 0.2


@dataclass
class PromptLookup:
    """Where each n-gram of a request's tokens last ended, indexed as the tokens grow (each token once)."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens [0, indexed) have had the n-grams ending at them indexed
    drafted: int = 0
    accepted: int = 0

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the most recent earlier occurrence of tokens' last n-gram."""
        if limit <= 0 or not self.worth_it():
            return []
        self._index(tokens, len(tokens) - 1)  # never the final n-gram itself: it has no continuation yet
        for n in NGRAM:
            if len(tokens) > n:
                end = self.ends.get(tuple(tokens[-n:]))
                if end is not None:
                    return list(tokens[end + 1 : end + 1 + limit])
        return []

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    def worth_it(self) -> bool:
        return self.drafted < GIVE_UP_AFTER or self.accepted >= GIVE_UP_RATE * self.drafted

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        for end in range(self.indexed, upto):
            for n in NGRAM:
                if end + 1 >= n:
                    self.ends[tuple(tokens[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, upto)


def accepted_prefix(draft: Sequence[int], greedy: Sequence[int]) -> int:
    """How many draft tokens greedy decoding confirms: greedy[i] is the model's choice after the draft's first i
    tokens, so draft[i] stands while it equals greedy[i]."""
    n = 0
    while n < len(draft) and draft[n] == greedy[n]:
        n += 1
    return n


def verify_sampled(
    draft: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator
) -> list[int]:
    """The tokens a sampled request emits from one speculative step: the draft's accepted prefix, then one token.

    p [len(draft) + 1, V]: the target's sampling distribution after the request's last token and after each draft
    token; q [len(draft), V]: the distributions the draft tokens were drawn from (None: drawn deterministically,
    prompt lookup's, i.e. q is one-hot). Draft token x stands with probability min(1, p(x) / q(x)); the first
    that falls is replaced by a draw from normalize(max(0, p - q)), and when all stand a bonus token is drawn from
    the last row of p. Every random number comes from the request's generator (a seed reproduces the step)."""
    for i, token in enumerate(draft):
        target = float(p[i, token])
        proposed = 1.0 if q is None else float(q[i, token])
        if float(torch.rand(1, generator=generator, device=generator.device)) * proposed < target:
            continue  # u < p/q, without dividing by a q that is never 0 here (x was drawn from it)
        residual = p[i].clone()
        if q is None:
            residual[token] = 0.0
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding (a fall needs p != q): p itself is then exact enough
            residual = p[i]
        return [*draft[:i], int(draw(residual.unsqueeze(0), [generator])[0])]
    return [*draft, int(draw(p[len(draft)].unsqueeze(0), [generator])[0])]
