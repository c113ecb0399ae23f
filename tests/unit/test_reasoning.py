"""The reasoning splitter (engines/reasoning.py): fed detokenized pieces, it keeps reasoning and content apart
exactly, however the tags are cut, and the mode comes from the template and the rendered prompt's tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.engines.reasoning import ReasoningMode, ReasoningSplitter, reasoning_mode

QWEN3_TAIL = "<|im_start|>assistant\n"
QWEN3_NO_THINK_TAIL = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
R1_TAIL = "<\uff5cAssistant\uff5c><think>\n"  # DeepSeek-R1's full-width bars
THINK_TEMPLATE = "{% if reasoning_content %}<think>\n{{ reasoning_content }}\n</think>{% endif %}"


def split(mode: ReasoningMode, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    splitter = ReasoningSplitter(mode)
    out = [splitter.push(p) for p in pieces]
    out.append(splitter.finish())
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


def every_cut(text: str) -> list[list[str]]:
    """The text in one piece, in characters, and cut in two at every position."""
    return [[text], list(text), *[[text[:i], text[i:]] for i in range(1, len(text))]]


@pytest.mark.parametrize("pieces", every_cut("<think>\nLet me see.\n</think>\n\nHello!"))
def test_tags_split_anywhere(pieces: list[str]) -> None:
    reasoning, content, _ = split("think", pieces)
    assert (reasoning, content) == ("Let me see.", "Hello!")


@pytest.mark.parametrize("pieces", every_cut("Let me see.\n</think>\n\nHello!"))
def test_block_opened_in_the_prompt_close_tag_only(pieces: list[str]) -> None:
    assert split("think_open", pieces)[:2] == ("Let me see.", "Hello!")


def test_prompt_opened_block_and_the_model_opens_again() -> None:
    assert split("think_open", ["<th", "ink>\nhmm", "</think>", "ok"])[:2] == ("hmm", "ok")


@pytest.mark.parametrize("pieces", every_cut("Hello, <think> is just a word here."))
def test_no_tags_at_all_is_content(pieces: list[str]) -> None:
    assert split("think", pieces)[:2] == ("", "Hello, <think> is just a word here.")


def test_a_reply_that_ends_inside_the_reasoning_is_all_reasoning() -> None:
    assert split("think", ["<think>", "still going", " </thi"])[:2] == ("still going </thi", "")
    assert split("think_open", ["cut short\n"])[:2] == ("cut short", "")


def test_nothing_is_held_longer_than_a_possible_tag_and_the_space_before_it() -> None:
    _, _, out = split("think", ["<think>", "abc", "def <", "/", "x", "</think>", "ans", "wer"])
    assert out == [("", ""), ("abc", ""), ("def", ""), ("", ""), (" </x", ""), ("", ""), ("", "ans"), ("", "wer"),
                   ("", "")]


def test_a_tag_begun_but_never_finished_is_content() -> None:
    assert split("think", ["<thi"])[:2] == ("", "<thi")
    assert split("think", ["<thi", "s is fine"])[:2] == ("", "<this is fine")


def test_mode_from_template_and_prompt_tail() -> None:
    assert reasoning_mode(THINK_TEMPLATE, QWEN3_TAIL) == "think"
    assert reasoning_mode(THINK_TEMPLATE, R1_TAIL) == "think_open"
    assert reasoning_mode(THINK_TEMPLATE, QWEN3_NO_THINK_TAIL) == "think"  # thinking off: a closed block
    assert reasoning_mode("{{ messages }}", QWEN3_TAIL) is None
    assert reasoning_mode(None, R1_TAIL) is None
    assert reasoning_mode("{{ messages }}", R1_TAIL, "think") == "think_open"  # the card's override
    assert reasoning_mode(THINK_TEMPLATE, R1_TAIL, "none") is None
    assert reasoning_mode("<|start|>assistant<|channel|>analysis", "<|start|>assistant") == "harmony"  # its channels


def test_template_switches_reach_the_template_and_decide_the_mode(tmp_path: Path) -> None:
    """enable_thinking and chat_template_kwargs are template variables; apply_chat_template's own arguments are
    not (a client cannot make it tokenize or swap the template); the mode comes from the rendered prompt."""
    from skulk.engines.torch.tokenizer import ChatTokenizer
    from skulk.models.demo import ensure_demo_model
    from skulk.types.chat import ChatMessage
    from tests.fake_hub import set_chat_template

    model = ensure_demo_model(tmp_path)
    set_chat_template(model, "{{ messages[0]['content'] }}<|im_start|>assistant\n"
                             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                             "{% elif open_think %}<think>\n{% endif %}")
    tokenizer = ChatTokenizer(model)
    hi = [ChatMessage(role="user", content="hi")]

    def rendered(kwargs: dict[str, object]) -> str:
        return str(tokenizer.hf.decode(tokenizer.encode_chat(hi, None, kwargs)))

    assert rendered({}).endswith("assistant\n")
    assert rendered({"enable_thinking": False}).endswith("</think>\n\n")
    assert rendered({"open_think": True, "tokenize": True, "chat_template": "x"}).endswith("<think>\n")
    assert tokenizer.reasoning_mode(tokenizer.encode_chat(hi, None, {"open_think": True})) == "think_open"
    assert tokenizer.reasoning_mode(tokenizer.encode_chat(hi, None, {"enable_thinking": False})) == "think"
    assert tokenizer.reasoning_mode(tokenizer.encode_chat(hi), "none") is None
