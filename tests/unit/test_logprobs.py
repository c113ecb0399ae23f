"""Log-probabilities: the sampler reports the model's own distribution (log_softmax of the raw logits) for the
rows that asked, and nothing for the others; the API shapes them as OpenAI's chat and legacy completions do."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from skulk.api.responses import legacy_logprobs
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.requests import Request, accept_each, logprobs_each, row_sampling
from skulk.engines.torch.sampling import token_logprobs
from skulk.engines.torch.tokenizer import IncrementalDecoder, StopMatcher
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatCompletionRequest, SamplingParams
from skulk.types.chunks import TokenLogprob, TopLogprob

pytestmark = pytest.mark.timeout(120)
VOCAB = 50


def _decode(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _request(rid: str, sampling: SamplingParams) -> Request:
    row = row_sampling(sampling, VOCAB, torch.device("cpu"), torch.Generator().manual_seed(1))
    return Request(rid, [1, 2], sampling.max_tokens, row, IncrementalDecoder(_decode), StopMatcher(sampling.stop))


def test_token_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    found = token_logprobs(logits, [4, 7, 9], [0, 3, 20])
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token, (logprob, top)) in enumerate(zip([4, 7, 9], found, strict=True)):
        assert logprob == pytest.approx(expected[row, token].item(), abs=1e-6)
        assert len(top) == [0, 3, 20][row]
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-6
        want = expected[row].topk(len(top)) if top else None
        if want is not None:
            assert [t for t, _ in top] == want.indices.tolist()


def test_only_rows_that_asked_pay_and_greedy_is_top_one() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    asked = _request("a", SamplingParams(temperature=0, logprobs=2))
    plain = _request("b", SamplingParams(temperature=0))
    hot = _request("c", SamplingParams(temperature=1.5, top_k=5, logprobs=0, seed=3))
    outs = accept_each(logits, [asked, plain, hot], eos_ids=set(), context_length=100, hook=None)
    assert outs[1].logprobs is None and outs[0].logprobs is not None and outs[2].logprobs is not None
    first = outs[0].logprobs
    assert first.token == _decode([outs[0].token_id]) and first.bytes == list(first.token.encode())
    assert first.top_logprobs[0].token == first.token  # greedy: the sampled token is the most likely
    assert first.logprob == pytest.approx(first.top_logprobs[0].logprob) and first.logprob <= 0
    # temperature and top-k do not change what is reported: it is the model's distribution
    raw = torch.log_softmax(logits[2], dim=-1)[outs[2].token_id].item()
    assert outs[2].logprobs.logprob == pytest.approx(raw, abs=1e-6) and outs[2].logprobs.top_logprobs == []


def test_no_row_asked_costs_nothing_and_failed_rows_are_skipped() -> None:
    logits = torch.randn(2, VOCAB)
    reqs = [_request("a", SamplingParams()), _request("b", SamplingParams(logprobs=1))]
    assert logprobs_each(logits, reqs[:1], [3]) == {}
    assert logprobs_each(logits, reqs, [3, ValueError("sampling failed")]) == {}


def test_chat_request_sampling_carries_top_logprobs() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).sampling().logprobs is None
    assert ChatCompletionRequest.model_validate({**base, "logprobs": True}).sampling().logprobs == 0
    with_top = ChatCompletionRequest.model_validate({**base, "logprobs": True, "top_logprobs": 5})
    assert with_top.sampling().logprobs == 5
    assert SamplingParams.model_validate_json(with_top.sampling().model_dump_json()).logprobs == 5  # the wire


def test_legacy_shape_offsets_follow_the_token_texts() -> None:
    entries = [TokenLogprob(token=t, logprob=-0.5, bytes=list(t.encode()),
                            top_logprobs=[TopLogprob(token=t, logprob=-0.5, bytes=list(t.encode()))])
               for t in ("He", "llo", " you")]
    shaped = legacy_logprobs(entries, 4)
    assert shaped == {"tokens": ["He", "llo", " you"], "token_logprobs": [-0.5] * 3,
                      "top_logprobs": [{"He": -0.5}, {"llo": -0.5}, {" you": -0.5}], "text_offset": [4, 6, 9]}


def test_engine_reports_the_models_first_step(tmp_path: Path) -> None:
    """One real step of the demo model: the first token's logprob is log_softmax of the prompt's last logits."""
    demo = ensure_demo_model(tmp_path)
    engine = TorchEngine(demo, max_batch=2, max_seq=128)
    prompt = [258, *b"hello", 10]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=4))
    outs = []
    while engine.has_work():
        outs.extend(engine.step())
    (out,) = outs
    model = load_model(demo)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), StepBatch.build(torch.arange(len(prompt)).unsqueeze(0), 0),
                       model.make_cache(1, 128))
    expected = torch.log_softmax(logits[0, -1].float(), dim=-1)
    assert out.logprobs is not None and out.token_id == int(expected.argmax())
    assert out.logprobs.logprob == pytest.approx(expected.max().item(), abs=1e-4)
    assert [t.logprob for t in out.logprobs.top_logprobs] == pytest.approx(expected.topk(4).values.tolist(),
                                                                            abs=1e-4)
