"""Speculative decoding of sampled requests (speculate.verify_sampled, the rejection rule of Leviathan et al. and
Chen et al.): the tokens follow exactly the distribution plain sampling draws from. Checked twice: the pure rule
on fixed distributions, and the engine with a draft model on two tiny random checkpoints, against the exact joint
distribution of four tokens that the target's own log-probabilities give. Every random number is seeded, so each
check gives the same figure every run; each also shows that a wrong rule (keeping every draft) would fail it."""

from __future__ import annotations

import logging
import math
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.requests import Request, accept_each
from skulk.engines.torch.speculate import verify_sampled
from skulk.models.demo import generate_random_llama
from skulk.types.chat import SamplingParams

pytestmark = pytest.mark.timeout(120)


def chi2_limit(dof: int, z: float = 3.09) -> float:
    """The chi-square statistic a correct sampler exceeds with probability 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: Counter[object], expected: dict[object, float], n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, over the outcomes expected at least 5 times (the rest pooled);
    an outcome the distribution gives no mass makes it infinite."""
    if any(expected.get(k, 0.0) <= 0 for k in counts):
        return math.inf, 1
    big = [k for k, p in expected.items() if p * n >= 5]
    cells = [(counts[k], expected[k] * n) for k in big]
    rest = n - sum(c for c, _ in cells), n * (1 - sum(expected[k] for k in big))
    if rest[1] >= 5:
        cells.append(rest)
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


# --- the rule alone ------------------------------------------------------------------------------------------

P = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]])
Q = torch.tensor([[0.1, 0.6, 0.1, 0.0, 0.2], [0.7, 0.1, 0.1, 0.1, 0.0]])


def draws(draft: list[int] | None, n: int = 4000) -> list[tuple[list[int], list[int]]]:
    """n steps of the rule: (draft, emitted) each. draft None: two tokens drawn from Q's rows each time (a draft
    model's); else that fixed draft (prompt lookup's, q one-hot)."""
    generator, drafting = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(99)
    out = []
    for _ in range(n):
        tokens = draft or [int(torch.multinomial(row, 1, generator=drafting)) for row in Q]
        out.append((tokens, verify_sampled(tokens, Q if draft is None else None, P, generator)))
    return out


@pytest.mark.parametrize("draft", [None, [0, 3], [3, 2], [4, 4]],
                         ids=["model-draft", "lookup-likely", "lookup-unlikely", "lookup-impossible"])
def test_the_rule_gives_the_target_distribution_at_each_position(draft: list[int] | None) -> None:
    """The first token follows P[0], and the second, where the first draft token stood, follows P[1]: whatever the
    draft distribution (a model's Q, or prompt lookup's one token)."""
    got = draws(draft)
    assert all(1 <= len(t) <= 3 and t[: len(t) - 1] == d[: len(t) - 1] for d, t in got)
    first = Counter(t[0] for _, t in got)
    stat, dof = chi2(first, dict(enumerate(P[0].tolist())), len(got))  # type: ignore[arg-type]
    assert stat < chi2_limit(dof), (first, stat)
    after = [t[1] for _, t in got if len(t) > 1]
    assert len(after) >= (0 if draft == [4, 4] else 120)
    if after:
        stat, dof = chi2(Counter(after), dict(enumerate(P[1].tolist())), len(after))  # type: ignore[arg-type]
        assert stat < chi2_limit(dof), stat


def test_keeping_every_draft_token_would_fail_the_check() -> None:
    """The check can fail: drafted tokens taken as they come follow Q, which it tells from P."""
    generator = torch.Generator().manual_seed(1234)
    naive = Counter(int(torch.multinomial(Q[0], 1, generator=generator)) for _ in range(6000))
    stat, dof = chi2(naive, dict(enumerate(P[0].tolist())), 6000)  # type: ignore[arg-type]
    assert stat > 10 * chi2_limit(dof)


def test_all_accepted_adds_a_bonus_token_from_the_last_distribution() -> None:
    same = P[:2].clone()
    generator = torch.Generator().manual_seed(7)
    got = [verify_sampled([0, 3], same, P, generator) for _ in range(3000)]  # p == q where it matters: q(x) <= p(x)
    bonus = Counter(t[2] for t in got if len(t) == 3)
    stat, dof = chi2(bonus, dict(enumerate(P[2].tolist())), sum(bonus.values()))  # type: ignore[arg-type]
    assert sum(bonus.values()) == 3000 and stat < chi2_limit(dof)


# --- the engine with a draft model ------------------------------------------------------------------------------

TOP_K = 3
SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K)
PROMPT = [256, 72, 101, 108, 108, 111]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-layer random target whose head is scaled up (peaked, varied distributions, not near-uniform ones), and
    a draft: the same checkpoint with a flatter, noisy head, so its top tokens overlap the target's only partly."""
    root = tmp_path_factory.mktemp("spec-sampling")
    target = generate_random_llama(root / "target", hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                   intermediate_size=64, seed=5)
    weights = load_file(str(target / "model.safetensors"))
    head = weights["lm_head.weight"]
    save_file({**weights, "lm_head.weight": head * 40}, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = root / "draft"
    shutil.copytree(target, draft)
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * head.std()
    save_file({**weights, "lm_head.weight": (head + noise / 2) * 20}, str(draft / "model.safetensors"),
              metadata={"format": "pt"})
    return target, draft


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """torch's two intra-op threads spin against each other on a loaded 2-core machine (a softmax of 16 x 258
    took 21 ms there, 4 us on one thread); these tiny models gain nothing from a second."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def generate(engine: TorchEngine, requests: dict[str, tuple[list[int], SamplingParams]],
             wave: int | None = None) -> dict[str, list[int]]:
    """Each request's tokens. wave: add that many at a time and run them out before the next (with every request
    admitted at once, nearly every step prefills a newcomer, and only a pure decode step speculates)."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    items = list(requests.items())
    wave = wave or len(items)
    for at in range(0, len(items), wave):
        for rid, (ids, sampling) in items[at : at + wave]:
            engine.add_request(rid, ids, sampling)
        while engine.has_work():
            for out in engine.step():
                assert out.error is None
                tokens[out.request_id].append(out.token_id)
    return tokens


def exact_joint(engine: TorchEngine, depth: int, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, ...], float]:
    """The probability of each sequence of `depth` tokens under temperature 1 and top-k, from the target's logits
    after every prefix (each prefix a plain request of one token, its logits caught on their way to the sampler):
    what plain sampling draws from."""
    from skulk.engines.torch import step

    caught: dict[str, torch.Tensor] = {}

    def catch(logits: torch.Tensor, reqs: list[Request], *args: Any) -> Any:
        caught.update({r.request_id: row.clone() for r, row in zip(reqs, logits, strict=True)})
        return accept_each(logits, reqs, *args)

    monkeypatch.setattr(step, "accept_each", catch)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        asks = {f"p{i}": (seq, p) for i, (seq, p) in enumerate(joint.items())}
        generate(engine, {rid: (PROMPT + list(seq), SamplingParams(max_tokens=1, temperature=0))
                          for rid, (seq, _) in asks.items()})
        joint = {}
        for rid, (seq, p) in asks.items():
            probs, tokens = torch.softmax(caught[rid].float(), -1).topk(TOP_K)
            joint |= {(*seq, t): p * q / float(probs.sum()) for t, q in zip(tokens.tolist(), probs.tolist(),
                                                                            strict=True)}
    monkeypatch.undo()
    return joint


@pytest.mark.slow  # engine compute on tiny models: `make test`, not `make test-fast`
def test_sampled_tokens_with_a_draft_model_follow_plain_sampling(
    models: tuple[Path, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 seeded requests of 3 tokens at temperature 1, top-k 3: the joint distribution of their tokens (27
    outcomes) is the target's own, though the draft, drawing from a different distribution, proposed the second
    (rejected ones replaced from the residual, a bonus third token when it stood). Keeping every draft would not
    pass: the draft's distribution is far from the target's (checked too). Added 8 at a time: the 8 prompts are
    prefilled in one step and then decode together (a step that also prefills does not speculate)."""
    target, draft = models
    expected = exact_joint(TorchEngine(target, max_seq=64, speculate=False), SAMPLED.max_tokens, monkeypatch)
    engine = TorchEngine(target, max_seq=64, draft_dir=draft)
    n = 1000
    with caplog.at_level(logging.INFO, logger="skulk.engines.torch.admission"):
        got = generate(engine, {f"s{i}": (PROMPT, SAMPLED.model_copy(update={"seed": i})) for i in range(n)}, 8)
    counts = Counter(tuple(t) for t in got.values())
    stat, dof = chi2(counts, expected, n)  # type: ignore[arg-type]
    assert stat < chi2_limit(dof), (stat, dof)
    rates = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MTP acceptance")]
    accepted = sum(int(m.split(": ")[1].split()[0]) for m in rates)
    drafted = sum(int(m.split(" of ")[1].split()[0]) for m in rates)
    assert 0.15 * drafted < accepted < 0.85 * drafted  # both branches of the rule ran, many times
    draft_first = exact_joint(TorchEngine(draft, max_seq=64, speculate=False), 1, monkeypatch)
    target_first = {k[:1]: 0.0 for k in expected}
    for k, p in expected.items():
        target_first[k[:1]] += p
    tv = sum(abs(draft_first.get(k, 0.0) - target_first.get(k, 0.0)) for k in {*draft_first, *target_first}) / 2
    assert tv > 0.2, tv  # the draft alone would give far other tokens


@pytest.mark.slow  # engine compute on tiny models: `make test`, not `make test-fast`
def test_greedy_stays_plain_and_a_seed_reproduces_sampled_tokens_beside_it(models: tuple[Path, Path]) -> None:
    target, draft = models
    greedy = SamplingParams(max_tokens=20, temperature=0)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=42)
    requests = {"g1": (PROMPT, greedy), "g2": ([256, 1, 2, 3], greedy), "s": (PROMPT, seeded)}
    plain = generate(TorchEngine(target, max_seq=64, speculate=False), requests)
    engine = TorchEngine(target, max_seq=64, draft_dir=draft)
    first = generate(engine, requests)
    again = generate(engine, requests)
    assert first["g1"] == plain["g1"] and first["g2"] == plain["g2"]
    assert again == first and len(first["s"]) == 20


@pytest.mark.slow  # engine compute on tiny models: `make test`, not `make test-fast`
def test_prompt_lookup_drafts_for_sampled_requests_too(models: tuple[Path, Path],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Prompt lookup proposes for a sampled request as well (its rule is verify_sampled with a one-token draft
    distribution, checked above): a near-greedy request on a prompt it repeats accepts most drafts."""
    target, _ = models
    engine = TorchEngine(target, max_seq=256)
    # a prompt whose greedy continuation has a few tokens before end-of-sequence (what the random model writes can
    # differ between CPUs' kernels; a continuation of one token would leave no decode step to draft in)
    for prompt in (PROMPT, *([256, *range(first, first + 5)] for first in range(80, 120, 5))):
        greedy = generate(engine, {"g": (prompt, SamplingParams(max_tokens=30, temperature=0))})["g"]
        if len(greedy) >= 4:
            break
    assert len(greedy) >= 4, "no candidate prompt has a greedy continuation of 4 tokens"
    echo = [*prompt, *greedy, *prompt]  # the greedy continuation follows the prompt once already
    cold = SamplingParams(max_tokens=30, temperature=0.05, seed=3)
    with caplog.at_level(logging.INFO, logger="skulk.engines.torch.admission"):
        generate(engine, {"s": (echo, cold)})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MTP acceptance")]
    assert len(lines) == 1 and "prompt-lookup" in lines[0], (lines, prompt, greedy)
    assert int(lines[0].split()[2]) >= 50
