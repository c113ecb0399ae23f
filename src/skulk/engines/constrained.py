"""Constrained decoding: a request's OutputConstraint (JSON, a JSON schema, or a forced tool call) becomes a
grammar that masks the logits of every step, so what the model writes always parses.

xgrammar does the work (grammar compilation, a token mask per step from its matcher, applied in place). It was
chosen over llguidance by measurement on SmolLM2's 49,152-token vocabulary (bench/constrained.py, median along a
JSON-schema text on this loaded 2-core machine): computing a row's mask 0.001 ms (xgrammar) against 0.011 ms
(llguidance), and mask plus application 0.2 ms against 12-22 ms with llguidance's torch helper; both compile a
schema in milliseconds. Its cost: xgrammar's wheel depends on triton (a large download, unused on CPU).

The engine's hook is two calls (engines/torch/requests.py): `mask_rows` before sampling (rows without a
constraint untouched, no copy when none has one) and `advance` with each row's token. A finished grammar allows
only the end-of-turn tokens, so a constrained reply ends as soon as its JSON or call is complete.

Tool calls are written in the format the API parses for the model's family (tool_parsers/, picked the same
way: the card's `tool_parser`, else the chat template's markers): Hermes tags (`<tool_call>{"name": ...,
"arguments": ...}</tool_call>`) by default and whenever the tools were rendered by us into the system message (the
template has no tools section); a bare JSON object with `parameters` for a Llama template that takes tools; a JSON
list for Mistral; and in their own special tokens for DeepSeek V3.1 (`<|tool calls begin|><|tool call begin|>f
<|tool sep|>{args}<|tool call end|><|tool calls end|>`, the bars fullwidth and the spaces U+2581, as
tool_parsers/special_tokens.py writes them), Kimi K2 (`<|tool_calls_section_begin|>
<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>`)
and gpt-oss harmony (`<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}`, then the
end-of-turn `<|call|>`): there the function's name is part of the fixed text and only the arguments are JSON,
one alternative per allowed tool. A harmony call may come after one analysis message (`<|channel|>analysis
<|message|>…<|end|><|start|>assistant`), as gpt-oss reasons before it calls (issue 42): the reply's opening
grammar allows that header or the call; once the header is out the reasoning is free and the call's grammar waits
for its end (engines/torch/requests.py's held_for_reasoning, as for a prompt that opened a `<think>` block; a
reasoning budget forces the end, engines/reasoning.py's HARMONY_TO_CALL). The literals match the vocabulary's
special tokens where it has them (xgrammar matches a token by its text), else their spelling in ordinary tokens.
Qwen3-Coder's and GLM-4.5's XML calls (`<function=f>`/`<parameter=k>`, `<arg_key>`/`<arg_value>`) are built in
xml_call_grammar.py: each parameter in its own tags, in any order, strings as raw text, other values as JSON of
their schema."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from skulk.engines.errors import PromptRejected
from skulk.engines.reasoning import HARMONY_TO_CALL
from skulk.engines.schema_refs import rebased
from skulk.engines.xml_call_grammar import XML_STYLES, xml_call_grammar
from skulk.types.chat import OutputConstraint

if TYPE_CHECKING:  # torch only for annotations: the API node imports call_schema to check a schema first
    import torch

HERMES, LLAMA_JSON, MISTRAL_LIST = "hermes", "llama", "mistral"
DEEPSEEK, KIMI, HARMONY = "deepseek_v31", "kimi_k2", "harmony"
"""The styles written in the family's own tokens: named as their parsers are (tool_parsers/). The XML styles,
qwen3_coder and glm45, are xml_call_grammar's XML_STYLES."""
_DS = {w: "<\uff5c" + w.replace(" ", "\u2581") + "\uff5c>" for w in (
    "tool calls begin", "tool call begin", "tool sep", "tool call end", "tool calls end")}
TOKEN_STYLES: dict[str, tuple[str, str]] = {  # (the text before the arguments, with {name}; the text after)
    DEEPSEEK: (_DS["tool calls begin"] + _DS["tool call begin"] + "{name}" + _DS["tool sep"],
               _DS["tool call end"] + _DS["tool calls end"]),
    KIMI: ("<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
           "<|tool_call_end|><|tool_calls_section_end|>"),
    HARMONY: ("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", ""),
}

HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", HARMONY_TO_CALL[1])
"""A forced harmony call may follow one analysis message: its header (the reply's opening grammar allows it), and the
next message's start that comes after its end (the grammar after the analysis begins with it)."""


class ConstraintError(PromptRejected):
    """The constraint cannot be compiled (a schema xgrammar does not support): the request ends with a 400."""


def tool_call_style(model_type: str, template_has_tools: bool, template: str, card_parser: str | None = None) -> str:
    """The tool-call format a forced call is written in (and the API parses back): the card's `tool_parser` where
    it names a format written here, else Hermes when we render the tools, else the template's own (its markers,
    as the API picks its parser: tool_parsers' pick_parser)."""
    from skulk.formats.tool_parsers import pick_parser

    if card_parser in (*TOKEN_STYLES, *XML_STYLES, HERMES):
        return card_parser
    if not template_has_tools:
        return HERMES
    picked = pick_parser(template, model_type).name
    if picked in TOKEN_STYLES or picked in XML_STYLES:
        return picked
    if "<tool_call>" in template:
        return HERMES
    if model_type.startswith("llama"):
        return LLAMA_JSON
    if model_type.startswith("mistral"):
        return MISTRAL_LIST
    return HERMES


def _allowed(constraint: OutputConstraint) -> list[dict[str, Any]]:
    tools = [t for t in constraint.tools if not constraint.tool_name or t.get("name") == constraint.tool_name]
    if not tools:
        raise ConstraintError("tool_choice names no tool that was offered")
    return tools


def _literal(text: str) -> str:
    """An EBNF grammar matching exactly `text`."""
    return "root ::= " + json.dumps(text, ensure_ascii=False)


def token_call_grammar(constraint: OutputConstraint, style: str) -> Any:
    """One call in a family's own tokens (TOKEN_STYLES): per allowed tool its fixed text, its name inside, around
    its arguments' schema; the alternatives joined."""
    import xgrammar as xgr

    before, after = TOKEN_STYLES[style]
    options = []
    for tool in _allowed(constraint):
        args = xgr.Grammar.from_json_schema(json.dumps(tool.get("parameters") or {"type": "object"}),
                                            any_whitespace=False, strict_mode=True)
        parts = [xgr.Grammar.from_ebnf(_literal(before.replace("{name}", tool["name"]))), args]
        parts += [xgr.Grammar.from_ebnf(_literal(after))] if after else []
        options.append(xgr.Grammar.concat(*parts))
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)


def harmony_call_grammars(constraint: OutputConstraint) -> tuple[Any, Any]:
    """A forced harmony call's two grammars: the reply's opening, an analysis message's header or the call; and
    what follows the analysis message once it has ended, the next message's start and the call."""
    import xgrammar as xgr

    call = token_call_grammar(constraint, HARMONY)
    head, after = HARMONY_ANALYSIS
    return (xgr.Grammar.union(xgr.Grammar.from_ebnf(_literal(head)), call),
            xgr.Grammar.concat(xgr.Grammar.from_ebnf(_literal(after)), call))


HARMONY_FINAL = "<|channel|>final<|message|>"
"""The final channel's header: a harmony reply's answer, where a JSON response_format applies (after any analysis)."""


def harmony_json_grammars(json_grammar: Any) -> tuple[Any, Any]:
    """A harmony reply held to a JSON schema: its opening, an analysis message's header or the final channel's
    header and the JSON; after the analysis, the next message's start, the final header and the JSON. The model
    reasons first where it wants to, and the schema applies to its answer alone."""
    import xgrammar as xgr

    answer = xgr.Grammar.concat(xgr.Grammar.from_ebnf(_literal(HARMONY_FINAL)), json_grammar)
    head, after = HARMONY_ANALYSIS
    return (xgr.Grammar.union(xgr.Grammar.from_ebnf(_literal(head)), answer),
            xgr.Grammar.concat(xgr.Grammar.from_ebnf(_literal(after)), answer))


def call_schema(constraint: OutputConstraint, style: str) -> dict[str, Any]:
    """The JSON schema of one call to an allowed tool: {"name": <that tool>, "arguments" (Llama: "parameters"):
    its parameters' schema}. The parameters' local references are moved with them (`#/$defs/x` becomes
    `#/properties/arguments/$defs/x`), so they still point into the parameters."""
    key = "parameters" if style == LLAMA_JSON else "arguments"
    tools = _allowed(constraint)
    options = []
    for i, tool in enumerate(tools):
        at = f"/properties/{key}" if len(tools) == 1 else f"/anyOf/{i}/properties/{key}"
        params = rebased(tool.get("parameters") or {"type": "object"}, at)
        options.append({"type": "object", "properties": {"name": {"const": tool["name"]}, key: params},
                        "required": ["name", key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


class Grammars:
    """One engine's compiler (its tokenizer's vocabulary and end-of-turn ids), built on first use; compiled
    grammars are cached by their constraint."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: Collection[int], tool_style: str) -> None:
        self._tokenizer, self._vocab, self._stops = hf_tokenizer, vocab_size, sorted(stop_ids)
        self.tool_style = tool_style
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab,
                                                          stop_token_ids=self._stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def matcher(self, constraint: OutputConstraint, harmony_reply: bool = False) -> Matcher:
        """A request's grammar state; `harmony_reply`: the reply is split as harmony's (the engine watches its
        analysis message, requests.held_for_reasoning), so a forced harmony call, or a JSON answer in the final
        channel, may follow one."""
        import xgrammar as xgr

        text = constraint.model_dump_json()
        if harmony_reply and (constraint.kind == "json" or self.tool_style == HARMONY):
            after = Matcher(xgr.GrammarMatcher(self._compile(text, "after_analysis")), self._vocab)
            return Matcher(xgr.GrammarMatcher(self._compile(text, "opening")), self._vocab, after)
        return Matcher(xgr.GrammarMatcher(self._compile(text)), self._vocab)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one Grammars per engine, kept for its life
    def _compile(self, constraint_json: str, part: str = "whole") -> Any:
        """The constraint's grammar compiled; `part`: a harmony reply's "opening" or "after_analysis"
        (harmony_call_grammars, harmony_json_grammars), else "whole"."""
        import xgrammar as xgr

        constraint = OutputConstraint.model_validate_json(constraint_json)
        compiler = self._get_compiler()
        try:
            if constraint.kind == "json":
                schema = json.dumps(constraint.json_schema or {"type": "object"})
                if part == "whole":
                    return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
                body = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
                opening, after = harmony_json_grammars(body)
                return compiler.compile_grammar(opening if part == "opening" else after)
            if part != "whole":
                opening, after = harmony_call_grammars(constraint)
                return compiler.compile_grammar(opening if part == "opening" else after)
            if self.tool_style in TOKEN_STYLES:
                return compiler.compile_grammar(token_call_grammar(constraint, self.tool_style))
            if self.tool_style in XML_STYLES:
                return compiler.compile_grammar(xml_call_grammar(_allowed(constraint), self.tool_style))
            schema = call_schema(constraint, self.tool_style)
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if self.tool_style == HERMES:
                grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                             xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
            elif self.tool_style == MISTRAL_LIST:
                grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "["'), body,
                                             xgr.Grammar.from_ebnf('root ::= "]"'))
            else:
                grammar = body
            return compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise ConstraintError(f"the output constraint cannot be compiled: {exc}") from exc


class Matcher:
    """One request's grammar state."""

    def __init__(self, matcher: Any, vocab: int, after_analysis: Matcher | None = None) -> None:
        self._m = matcher
        self.vocab = vocab
        self.after_analysis = after_analysis
        """A forced harmony call's: the grammar once the analysis message this one lets open has ended (None: this
        grammar lets none open)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """This request's allowed next tokens into row `row` of a batch bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> bool:
        """Take the sampled token; False when the grammar did not allow it (a scripted token in the tests)."""
        return bool(self._m.accept_token(token))

    def advance_text(self, text: str) -> bool:
        """Take text that came with a token before this grammar applied (the rest of the token that ended the
        analysis message); False when the grammar does not allow it."""
        return not text or bool(self._m.accept_string(text))


def mask_rows(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """logits [B, V] with each constrained row's disallowed tokens at -inf: a copy (the raw logits still give
    reported log-probabilities), masked in one call for all its rows; the same tensor when no row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    masked = logits.float().clone()
    bitmask = xgr.allocate_token_bitmask(masked.shape[0], masked.shape[-1])
    for i in rows:
        matcher = matchers[i]
        if matcher is not None:
            matcher.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(masked, bitmask, indices=rows)
    return masked
