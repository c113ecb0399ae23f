"""Token sampling for a batch: temperature, top-k and top-p as tensor ops over all rows at once.

Each row draws its one uniform number from its request's own torch.Generator, so a seeded request samples the
same tokens whatever else shares its batch; the draw is then an inverse-CDF lookup for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowSampling:
    """One request's sampling settings; temperature 0 means greedy."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator
    logprobs: int | None = None
    """None: no log-probabilities; n: the sampled token's and the n most likely tokens' (0...20)."""


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token [..., V] -> [...], compared in float32, a tie going to the lowest token id.

    The logits arrive in float32 (model.ModelSlice: the head's accumulator, unrounded), so a tie is an exact one;
    torch's argmax returns the first maximal index on every backend (documented), which makes the tie-break the
    same on one node, a Pipeline and a Tensor split. .float() is a no-op on float32 input: no copy per step."""
    return logits.float().argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[RowSampling]) -> list[int]:
    """One token id per row of logits [B, V] (float32)."""
    greedy_ids = greedy(logits)
    if all(r.temperature <= 0 for r in rows):
        return greedy_ids.tolist()
    drawn = draw(distribution(logits, rows), [r.generator for r in rows])
    is_greedy = torch.tensor([r.temperature <= 0 for r in rows], device=logits.device)
    return torch.where(is_greedy, greedy_ids, drawn).tolist()


def distribution(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """The probabilities [B, V] each row samples from: softmax of its logits over its temperature (1 for a greedy
    row), after top-k and top-p. Speculative decoding's rejection rule compares the target's and the draft's."""
    temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], device=logits.device)
    scaled = logits.float() / temperature.unsqueeze(1)
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        scaled = _filter(scaled, rows)
    return torch.softmax(scaled, dim=-1)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of probs [B, V] (unnormalized is fine), by inverse CDF from one uniform number drawn
    from the row's generator."""
    cdf = probs.cumsum(dim=-1)
    uniform = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators])
    target = (uniform.to(probs.device) * cdf[:, -1]).unsqueeze(1)
    # right-side search: the first token whose cumulative mass exceeds the target, never a zero-mass one
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _filter(scaled: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Mask out tokens outside each row's top-k and top-p nucleus (k=0 and p=1 keep everything)."""
    device, vocab = scaled.device, scaled.shape[-1]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], device=device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p.unsqueeze(1)  # keeps the first token always: its mass_before is 0
    return scaled.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of logits [B, V]: the log-probability of tokens[row] and the top[row] most likely (id, logprob),
    most likely first.

    Of the model's own distribution (log_softmax of the raw logits), not of the temperature-scaled and
    top-k/top-p filtered one the token was drawn from: it is what the model thinks of each token, and the same
    whatever sampling settings a client picks (what OpenAI and vLLM report). Callers pass only the rows that
    asked, so a batch where nobody asked pays nothing."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(top, default=0)
    if k == 0:
        return [(c, []) for c in chosen]
    values, ids = logprobs.topk(min(k, logits.shape[-1]), dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [
        (c, list(zip(ids_l[row][:n], values_l[row][:n], strict=True)))
        for row, (c, n) in enumerate(zip(chosen, top, strict=True))
    ]
