"""The torch engine's transformers fallback (engines/torch/fallback.py) on the families people pool machines for.

For each family of family_checkpoints (DeepSeek V3, GLM-4 MoE, Mixtral, MiniMax M2, Qwen3-MoE, Qwen3-Next,
Nemotron-H, Gemma 4, gpt-oss, Llama 4), two concurrent requests' 16 greedy tokens are transformers' own (its
forward over the whole sequence each step, no cache): the fallback's per-request caches, its interleaving of
requests and the native engine's sampler it reuses change nothing (DeepSeek V3 and GLM-4 MoE run natively too,
models/; the fallback still runs them, and their checks here stay). Then what a client sees beyond greedy
tokens, on one family: a cancelled request frees its cache, a stop string ends the reply, log-probabilities are
transformers', a JSON schema constrains the reply, and the runner's events come in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skulk.engines.base import Engine
from skulk.engines.torch.fallback import FallbackEngine
from skulk.engines.torch.wire import Admitted, Released, Started
from skulk.types.chat import OutputConstraint, SamplingParams
from tests.unit.family_checkpoints import (
    FAMILIES,
    MORE,
    PROMPTS,
    TOKENS,
    Reference,
    disagreement,
    reference,
    tokenizer_donor,
    write,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback-families")
    demo = tokenizer_donor(root)
    return {name: write(name, root, demo) for name in (*FAMILIES, *MORE)}


def run(engine: Engine, sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """Both prompts at once through any engine; every token by request, failing on any error."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, sampling)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.token_id)
    return got


def test_every_family_gives_transformers_tokens(checkpoints: dict[str, Path]) -> None:
    wrong = {}
    for name, path in checkpoints.items():
        expected: Reference = reference(path)
        if (why := disagreement(run(FallbackEngine(path, max_seq=256)), expected)):
            wrong[name] = why
    assert not wrong, wrong


def test_cancel_stop_logprobs_grammar_and_events(checkpoints: dict[str, Path]) -> None:
    engine = FallbackEngine(checkpoints["mixtral"], max_seq=256)  # a family only the fallback runs
    engine.warmup()
    assert engine.take_events() == [] and not engine.has_work()
    engine.add_request("gone", PROMPTS[0], GREEDY)
    engine.add_request("kept", PROMPTS[1], GREEDY.model_copy(update={"logprobs": 2}))
    first = engine.step()  # prefills "gone" (one prompt per step)
    engine.cancel("gone")
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in first] == ["gone"] and "gone" not in {o.request_id for o in outs}
    assert set(engine._caches) == {"kept"}, "a cancelled request's cache is freed"
    kinds = [(type(e).__name__, e.request_id) for e in engine.take_events()]
    assert kinds[:4] == [("Admitted", "gone"), ("Admitted", "kept"), ("Started", "gone"), ("Released", "gone")]
    assert ("Started", "kept") in kinds
    logprob = next(o.logprobs for o in outs if o.request_id == "kept" and o.logprobs is not None)
    assert logprob is not None and len(logprob.top_logprobs) == 2 and logprob.logprob <= 0
    engine.cancel("kept")
    engine.step()
    assert [type(e).__name__ for e in engine.take_events()] == ["Released"] and not engine.has_work()

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    engine.add_request("json", PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                          constraint=OutputConstraint(kind="json", json_schema=schema)))
    text = ""
    while engine.has_work():
        text += "".join(o.text for o in engine.step())
    assert isinstance(json.loads(text)["n"], int), text
    events = engine.take_events()
    assert isinstance(events[0], Admitted) and isinstance(events[1], Started) and isinstance(events[-1], Released)


def test_a_stop_string_ends_the_reply(checkpoints: dict[str, Path]) -> None:
    """The stop string is the reply's own text after a few tokens: the reply ends there, without it."""
    engine = FallbackEngine(checkpoints["qwen3_next"], max_seq=256)
    engine.add_request("a", PROMPTS[1], GREEDY)
    full = ""
    while engine.has_work():
        full += "".join(o.text for o in engine.step())
    stop = full[len(full) // 2 :][:2]
    assert stop.strip(), full
    engine.add_request("b", PROMPTS[1], GREEDY.model_copy(update={"stop": [stop]}))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_sequence == stop
    assert "".join(o.text for o in outs) == full[: full.index(stop)]
