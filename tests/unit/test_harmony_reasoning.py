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


def test_a_forced_harmony_call_is_split_as_harmony_on_the_api_node() -> None:
    """The runner reports no split for a constrained reply, but a forced call in harmony's format may open with an
    analysis message (engines/constrained.py): the API node reads that reply as harmony's (a reply that is the
    call alone splits the same: all content), and leaves every other reply as the runner said."""
    from skulk.api.chat_session import harmony_call_split
    from skulk.api.services import ApiServices
    from skulk.types.chat import ChatCompletionRequest
    from skulk.types.chunks import TokenChunk
    from skulk.types.ids import CommandId
    from skulk.types.state import State
    from tests.unit.factories import CARD, api_services

    def node(parser: str) -> ApiServices:
        card = CARD.model_copy(update={"tool_parser": parser})
        return api_services(state=State(model_cards={card.model_id: card}))

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    forced = ChatCompletionRequest.model_validate({"model": CARD.model_id, "tools": [tool], "tool_choice": "required",
                                                   "messages": [{"role": "user", "content": "Weather?"}]})
    first = TokenChunk(command_id=CommandId("c"), text="<|channel|>", token_id=1)
    harmony = node("harmony")
    assert harmony_call_split(harmony, forced, first).reasoning == "harmony"
    free = forced.model_copy(update={"tool_choice": "auto"})
    assert harmony_call_split(harmony, free, first).reasoning is None
    assert harmony_call_split(node("hermes"), forced, first).reasoning is None
    opened = first.model_copy(update={"reasoning": "think_open"})
    assert harmony_call_split(harmony, forced, opened).reasoning == "think_open"
