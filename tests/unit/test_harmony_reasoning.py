"""gpt-oss's harmony channels (engines/harmony.py): analysis is reasoning, final and preambles are content, a call
goes on whole for the tool parser; the same split whether the text comes whole or cut at any character."""

from __future__ import annotations

import pytest

from skulk.api.tool_calls import parse_tool_calls
from skulk.engines.harmony import HarmonySplitter
from skulk.engines.reasoning import reasoning_mode, splitter_for

CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALL = CALL_HEADER + '{"city": "Paris"}'
# (reply text, reasoning, content)
CASES = [
    ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
     "User says hi.", "Hello!"),
    ("<|channel|>analysis<|message|>Need weather.<|end|>" + CALL, "Need weather.", CALL),
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     + CALL + "<|call|>", "Plan.", "Checking." + CALL + "<|call|>"),
    ("<|channel|>final<|message|>Just the answer.<|return|>", "", "Just the answer."),
    ("No channels at all, a < b.", "", "No channels at all, a < b."),
    ("<|channel|>analysis<|message|>Cut off mid-thought <|e", "Cut off mid-thought <|e", ""),
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|>"
     "<|start|>assistant<|channel|>final<|message|>C", "AB", "C"),
]


def _split(pieces: list[str]) -> tuple[str, str]:
    splitter = HarmonySplitter()
    parts = [splitter.push(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_channels_split_whole_and_at_every_boundary(text: str, reasoning: str, content: str) -> None:
    assert _split([text]) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _split([text[:i], text[i:]]) == (reasoning, content), i
    assert _split(list(text)) == (reasoning, content)


def test_the_call_left_in_the_content_is_read_by_the_harmony_tool_parser() -> None:
    _, content = _split(["<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary"
                         "<|message|>Checking.<|end|>", CALL])
    left, calls = parse_tool_calls("harmony", content, "x")
    assert left == "Checking." and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}')]


def test_a_harmony_template_picks_the_harmony_splitter() -> None:
    template = "{{- '<|start|>assistant<|channel|>analysis<|message|>' }}"
    assert reasoning_mode(template, "<|start|>assistant") == "harmony"
    assert reasoning_mode(template, "<|start|>assistant", "none") is None
    assert reasoning_mode("{{ messages }}", "", "harmony") == "harmony"
    assert isinstance(splitter_for("harmony"), HarmonySplitter) and not isinstance(splitter_for("think"),
                                                                                   HarmonySplitter)
