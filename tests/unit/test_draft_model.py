"""Speculative decoding with a draft model (engines/torch/drafter.py): a smaller checkpoint of the same tokenizer
drafts, the target verifies, and the output is plain greedy decoding's, token for token. Two generated random
checkpoints: the demo model as target, a one-layer model as draft. Counted in tokens and steps, never in time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import ensure_demo_model, generate_random_llama
from skulk.types.chat import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # runs real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=24, temperature=0)
TEXT = [*b"A draft model proposes, the target disposes: only the tokens it would have chosen stand. "] * 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    draft = generate_random_llama(root / "draft", hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                  intermediate_size=64, seed=11)
    return ensure_demo_model(root), draft


def prompt(n: int, salt: int = 0) -> list[int]:
    return [256, *((w + salt) % 250 + 1 for w in TEXT)][:n]


REQUESTS = {"a": prompt(40), "b": prompt(75, salt=3), "c": prompt(9, salt=5)}


def run(engine: TorchEngine, requests: dict[str, list[int]]) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens, and the steps that produced them."""
    for rid, ids in requests.items():
        engine.add_request(rid, ids, GREEDY)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_work():
        steps += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return tokens, steps


def acceptance(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("MTP acceptance")]


def test_a_smaller_draft_model_gives_the_tokens_of_plain_decoding(
    models: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    target, draft = models
    plain, _ = run(TorchEngine(target, max_seq=256, speculate=False), REQUESTS)
    engine = TorchEngine(target, max_seq=256, draft_dir=draft)
    assert engine.drafter is not None
    with caplog.at_level(logging.INFO, logger="skulk.engines.torch.admission"):
        got, _ = run(engine, REQUESTS)
    assert got == plain
    lines = acceptance(caplog)  # the runbook's words, per request
    assert len(lines) == 3 and all("draft-model draft tokens accepted" in line for line in lines)


def test_a_draft_that_agrees_moves_several_tokens_a_step_and_still_gives_plain_tokens(
    models: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The target as its own draft: most drafts stand, so a step emits several tokens per request (the draft's KV is
    kept valid across accepted and rejected drafts), and the tokens are still plain decoding's."""
    target, _ = models
    plain, plain_steps = run(TorchEngine(target, max_seq=256, speculate=False), REQUESTS)
    with caplog.at_level(logging.INFO, logger="skulk.engines.torch.admission"):
        got, steps = run(TorchEngine(target, max_seq=256, draft_dir=target), REQUESTS)
    assert got == plain
    assert steps < plain_steps / 2
    rates = [int(line.split()[2]) for line in acceptance(caplog)]
    assert len(rates) == 3 and min(rates) >= 50


def test_a_draft_of_another_vocabulary_is_refused(models: tuple[Path, Path], tmp_path: Path) -> None:
    import json

    target, draft = models
    other = tmp_path / "other"
    other.mkdir()
    for f in draft.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(ValueError, match="draft must use the target's tokenizer"):
        TorchEngine(target, max_seq=256, draft_dir=other)
