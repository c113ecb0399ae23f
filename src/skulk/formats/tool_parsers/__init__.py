"""One registry of tool-call formats, one parser per family format, and how a model's parser is picked.

Picked (`pick_parser`) in this order: the card's `tool_parser`; the chat template's text (the markers it writes
in a call, as Skulk reads them: a template that renders DeepSeek's `tool▁calls▁begin` token makes its model
answer in it); the family name; Hermes `<tool_call>` JSON for everything else (ChatML templates). Each
format's module says what its text looks like; base.py what a parser is."""

from __future__ import annotations

from typing import get_args

from skulk.formats.tool_parsers.base import RawCall, Split, ToolParser
from skulk.formats.tool_parsers.coerce import coerce_arguments
from skulk.formats.tool_parsers.plain_json import (
    MISTRAL_TAG,
    PYTHON_TAG,
    llama3_bare,
    llama3_closed,
    llama3_split,
    mistral_bare,
    mistral_closed,
    mistral_split,
)
from skulk.formats.tool_parsers.special_tokens import (
    DS_CLOSE,
    DS_MARKERS,
    HARMONY_CLOSE,
    HARMONY_MARKERS,
    KIMI_CLOSE,
    KIMI_MARKERS,
    deepseek_split,
    harmony_split,
    kimi_split,
)
from skulk.formats.tool_parsers.tagged import CLOSE, OPEN, glm45_split, hermes_split, qwen3_coder_split
from skulk.types.models import ToolParserName

__all__ = ["PARSERS", "RawCall", "ToolParser", "coerce_arguments", "parser_for", "pick_parser"]

def _or_hermes(split: Split) -> Split:
    """A format's split that also reads Hermes `<tool_call>` JSON: the tools of a template without a tools section
    are offered in Hermes' words (engines/tool_prompt.py), and a forced call is then written so; where the template
    renders the tools, a forced call is in the family's own tokens (engines/constrained.py's tool_call_style)."""

    def read(text: str) -> tuple[str, list[RawCall]] | None:
        found = split(text)
        return found if found is not None or OPEN not in text else hermes_split(text)

    return read


PARSERS: dict[ToolParserName, ToolParser] = {
    p.name: p  # type: ignore[misc]
    for p in (  # template detection tries them in this order: the most specific marks first
        ToolParser("harmony", (*HARMONY_MARKERS, OPEN), _or_hermes(harmony_split), ("<|channel|>", "functions."),
                   closers=(HARMONY_CLOSE, CLOSE)),
        ToolParser("deepseek_v31", (*DS_MARKERS, OPEN), _or_hermes(deepseek_split), ("tool▁calls▁begin",),
                   closers=(DS_CLOSE, CLOSE)),
        ToolParser("kimi_k2", (*KIMI_MARKERS, OPEN), _or_hermes(kimi_split),
                   ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), closers=(KIMI_CLOSE, CLOSE)),
        ToolParser("glm45", (OPEN,), glm45_split, ("<arg_key>",), closers=(CLOSE,)),
        ToolParser("qwen3_coder", (OPEN,), qwen3_coder_split, ("<function=", "<parameter="), closers=(CLOSE,)),
        ToolParser("mistral", (MISTRAL_TAG, OPEN), mistral_split, (MISTRAL_TAG,), mistral_bare, closed=mistral_closed),
        ToolParser("llama3", (OPEN,), llama3_split, (PYTHON_TAG, "JSON for a function call"), llama3_bare,
                   closed=llama3_closed),
        ToolParser("hermes", (OPEN,), hermes_split, (OPEN,), closers=(CLOSE,)),
    )
}
assert set(PARSERS) == set(get_args(ToolParserName)), "every name a card may give has a parser"

_FAMILY_PREFIXES: tuple[tuple[str, ToolParserName], ...] = (
    ("gpt_oss", "harmony"), ("gpt-oss", "harmony"), ("kimi", "kimi_k2"), ("deepseek", "deepseek_v31"),
    ("glm4_moe", "glm45"), ("glm-4.5", "glm45"), ("llama", "llama3"), ("mistral", "mistral"),
    ("mixtral", "mistral"), ("qwen3_coder", "qwen3_coder"),
)


def _from_template(template: str) -> ToolParser | None:
    """The first parser all of whose template marks the template text holds (harmony needs both of its)."""
    for parser in PARSERS.values():
        marks = parser.template_marks
        if parser.name == "harmony" and marks and all(m in template for m in marks):
            return parser
        if parser.name != "harmony" and any(m in template for m in marks):
            return parser
    return None


def parser_for(key: str) -> ToolParser:
    """A parser by its registry name, else by model family name (Hermes when the family says nothing)."""
    if key in PARSERS:
        return PARSERS[key]  # type: ignore[index]
    family = key.lower()
    return next((PARSERS[n] for prefix, n in _FAMILY_PREFIXES if family.startswith(prefix)), PARSERS["hermes"])


def pick_parser(template: str | None, family: str, override: ToolParserName | None = None) -> ToolParser:
    """The card's override, else the template's markers, else the family name (the module's docstring)."""
    if override is not None:
        return PARSERS[override]
    found = _from_template(template) if template else None
    return found if found is not None else parser_for(family)
