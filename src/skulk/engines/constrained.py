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

Tool calls are written in the format the API parses for the model's family (api/tool_calls.py): Hermes tags
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) by default and whenever the tools were rendered by us
into the system message (the template has no tools section); a bare JSON object with `parameters` for a Llama
template that takes tools; a JSON list for Mistral."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from skulk.engines.errors import PromptRejected
from skulk.engines.schema_refs import rebased
from skulk.types.chat import OutputConstraint

if TYPE_CHECKING:  # torch only for annotations: the API node imports call_schema to check a schema first
    import torch

HERMES, LLAMA_JSON, MISTRAL_LIST = "hermes", "llama", "mistral"


class ConstraintError(PromptRejected):
    """The constraint cannot be compiled (a schema xgrammar does not support): the request ends with a 400."""


def tool_call_style(model_type: str, template_has_tools: bool, template: str) -> str:
    """The tool-call format a forced call is written in (and the API parses back): the template's own when it
    shows one, Hermes when we render the tools."""
    if not template_has_tools or "<tool_call>" in template:
        return HERMES
    if model_type.startswith("llama"):
        return LLAMA_JSON
    if model_type.startswith("mistral"):
        return MISTRAL_LIST
    return HERMES


def call_schema(constraint: OutputConstraint, style: str) -> dict[str, Any]:
    """The JSON schema of one call to an allowed tool: {"name": <that tool>, "arguments" (Llama: "parameters"):
    its parameters' schema}. The parameters' local references are moved with them (`#/$defs/x` becomes
    `#/properties/arguments/$defs/x`), so they still point into the parameters."""
    key = "parameters" if style == LLAMA_JSON else "arguments"
    tools = [t for t in constraint.tools if not constraint.tool_name or t.get("name") == constraint.tool_name]
    if not tools:
        raise ConstraintError("tool_choice names no tool that was offered")
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

    def matcher(self, constraint: OutputConstraint) -> Matcher:
        import xgrammar as xgr

        compiled = self._compile(constraint.model_dump_json())
        return Matcher(xgr.GrammarMatcher(compiled), self._vocab)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one Grammars per engine, kept for its life
    def _compile(self, constraint_json: str) -> Any:
        import xgrammar as xgr

        constraint = OutputConstraint.model_validate_json(constraint_json)
        compiler = self._get_compiler()
        try:
            if constraint.kind == "json":
                schema = constraint.json_schema or {"type": "object"}
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
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

    def __init__(self, matcher: Any, vocab: int) -> None:
        self._m = matcher
        self.vocab = vocab

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """This request's allowed next tokens into row `row` of a batch bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> bool:
        """Take the sampled token; False when the grammar did not allow it (a scripted token in the tests)."""
        return bool(self._m.accept_token(token))


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
