"""A reasoning budget (Claude's `thinking.budget_tokens`) caps the reasoning, not the reply: on the rank that samples,
when the reasoning and its close would reach the budget, the engine forces the family's close and the model goes
on with its answer (engines/reasoning.py's ReasoningBudget, engines/torch/requests.py). Tested on the torch engine
with the demo checkpoint, a thinking template and a scripted reply (SKULK_FAULT=script:reply's hook), which, like a
model, answers once its reasoning has been closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.engines.base import TokenOut
from skulk.engines.reasoning import CLOSE_TEXT, ReasoningBudget, ReasoningMode, ReasoningTally
from skulk.engines.torch.engine import TorchEngine
from skulk.models.demo import ensure_demo_model
from skulk.runner.fault import ScriptFault, engine_hook
from skulk.types.chat import ChatMessage, SamplingParams
from tests.fake_hub import set_chat_template

pytestmark = pytest.mark.timeout(120)

TEMPLATE = (  # ChatML with Qwen3's thinking switch, and a test-only `open_think` (DeepSeek-R1's opened block)
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if open_think is defined and open_think %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
HARMONY_TEMPLATE = (  # gpt-oss' message headers, enough for the mode to be harmony
    "{%- for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    "{#- <|channel|> #}"
)
REASONING = " ".join(f"step{i}" for i in range(30))  # a token a byte: the demo vocabulary is bytes
ANSWER = "Hello there!"
SCRIPTS: dict[ReasoningMode, str] = {
    "think": f"<think>\n{REASONING}\n</think>\n\n{ANSWER}",
    "think_open": f"{REASONING}\n</think>\n\n{ANSWER}",
    "harmony": f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, template in (("think", TEMPLATE), ("harmony", HARMONY_TEMPLATE)):
        model = ensure_demo_model(tmp_path_factory.mktemp(name))
        set_chat_template(model, template)
        out[name] = model
    return out


def reply(model: Path, mode: ReasoningMode, budget: int | None, max_tokens: int = 400) -> list[TokenOut]:
    engine = TorchEngine(model, max_seq=1024)
    engine.fault_hook = engine_hook(ScriptFault(), 0, engine.tokenizer)
    ask = [ChatMessage(role="user", content=f"Hi SKULK_SCRIPT<<<{SCRIPTS[mode]}>>>")]
    prompt = engine.tokenizer.encode_chat(ask, None, {"open_think": mode == "think_open"})
    assert engine.tokenizer.reasoning_mode(prompt) == mode
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, reasoning_budget=budget))
    outs: list[TokenOut] = []
    while engine.has_work():
        outs += engine.step()
    return outs


def split(mode: ReasoningMode, outs: list[TokenOut]) -> tuple[str, str, int]:
    """(reasoning, content, reasoning tokens) as the API node reads the reply (api/generation.py)."""
    tally = ReasoningTally(mode)
    pieces = [tally.push(o.text) for o in outs]
    pieces.append(tally.splitter.finish())
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces), tally.tokens


@pytest.mark.parametrize("mode", ["think", "think_open", "harmony"])
def test_the_budget_closes_the_reasoning_and_the_answer_follows(models: dict[str, Path], mode: ReasoningMode) -> None:
    model = models["harmony" if mode == "harmony" else "think"]
    full = reply(model, mode, None)
    assert split(mode, full)[:2] == (REASONING, ANSWER)
    assert split(mode, full)[2] > 100, "the budget below must cut this reasoning"
    capped = reply(model, mode, 60)
    reasoning, content, tokens = split(mode, capped)
    assert 45 < tokens <= 60 and REASONING.startswith(reasoning) and 0 < len(reasoning) < len(REASONING)
    assert content == ANSWER and capped[-1].finish_reason == "stop" and all(o.error is None for o in capped)
    assert len(capped) < len(full)


def test_a_reasoning_within_its_budget_is_untouched(models: dict[str, Path]) -> None:
    full = reply(models["think"], "think", None)
    assert [o.token_id for o in reply(models["think"], "think", 1000)] == [o.token_id for o in full]


def test_max_tokens_still_ends_the_reply(models: dict[str, Path]) -> None:
    outs = reply(models["think"], "think", 30, max_tokens=32)
    assert len(outs) == 32 and outs[-1].finish_reason == "length"


def test_budget_counts_as_the_api_does_and_forces_the_close_once() -> None:
    close = [7, 8, 9, 10]  # the first three count as reasoning (CLOSE_TEXT's first part)
    budget = ReasoningBudget("think_open", 10, close, 3)
    forced = [budget.after(piece) for piece in ["a", " b", " c", " d", " e", " f", " g"]]
    assert forced == [[], [], [], [], [], [], close]  # 7 tokens + a close of 3 reach 10
    assert budget.after("\n</think>\n\n") == [] and budget.after("answer") == []
    assert "".join(CLOSE_TEXT["think"]).strip() == "</think>"


def test_a_speculating_engine_forces_the_same_close(models: dict[str, Path]) -> None:
    """Sampled, not scripted (a script turns drafting off): the prompt opened the block, so the random model's greedy
    text is reasoning from its first token. With prompt-lookup drafts on, a draft's tokens past the budget are not
    kept: the close comes where it comes without drafts, and the reply is the same token for token."""
    replies = []
    for speculate in (False, True):
        engine = TorchEngine(models["think"], max_seq=1024, speculate=speculate)
        prompt = engine.tokenizer.encode_chat([ChatMessage(role="user", content="Hi")], None, {"open_think": True})
        engine.add_request("r", prompt, SamplingParams(max_tokens=120, temperature=0, reasoning_budget=50))
        outs: list[TokenOut] = []
        while engine.has_work():
            outs += engine.step()
        replies.append([o.token_id for o in outs])
        reasoning, _, tokens = split("think_open", outs)
        assert tokens <= 50 and "</think>" in "".join(o.text for o in outs) and reasoning
    assert replies[0] == replies[1]


def test_a_constrained_reply_reasons_first_and_its_grammar_holds_the_answer(models: dict[str, Path]) -> None:
    """A prompt that opened the reasoning block: the grammar waits for the close (here forced by the budget, as
    the random model never writes one) and holds the answer only; before, it held the reasoning's first token."""
    from skulk.types.chat import OutputConstraint

    engine = TorchEngine(models["think"], max_seq=1024)
    prompt = engine.tokenizer.encode_chat([ChatMessage(role="user", content="yes or no?")], None, {"open_think": True})
    assert engine.tokenizer.reasoning_mode(prompt) == "think_open"
    schema = {"type": "string", "enum": ["yes", "no"]}
    constraint = OutputConstraint(kind="json", json_schema=schema)
    engine.add_request("r", prompt, SamplingParams(max_tokens=200, temperature=0, reasoning_budget=20,
                                                   constraint=constraint))
    text = ""
    while engine.has_work():
        text += "".join(o.text for o in engine.step())
    reasoning, close, answer = text.partition("</think>")
    assert close, text
    assert len(reasoning) + len(close) <= 20  # a token a byte
    assert answer.strip() in ('"yes"', '"no"'), answer
