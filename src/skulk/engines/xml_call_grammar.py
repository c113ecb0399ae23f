"""Forced tool calls in the two XML-tagged formats, written as their templates write a call and as their parsers
(formats/tool_parsers/tagged.py) read one back:

- Qwen3-Coder: `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>`;
- GLM-4.5: `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>value</arg_value>\\n...</tool_call>`.

Their templates write a string argument as its raw text and anything else as JSON (`tojson`), and the parsers
read every value as text and coerce it to the tool's schema type (tool_parsers/coerce.py), in whatever order
the parameters come. So the grammar, one alternative per allowed tool, is: the function's name in fixed text; the
schema's parameters in any order, each at most once, the required ones present, no others; a value whose schema
allows a string (or says no type) as text that holds none of the closing tags the parser's non-greedy matches stop
at (else the call would be read cut short), one of the strings where the schema is an enum of strings, and any
other value as JSON of its schema (xgrammar's, no free whitespace). What is not enforced: a string's own
constraints (pattern, length, format), and closing tags inside a JSON string nested in an object or array value.

Any order without listing orders: one rule per set of parameters already written (`_any_order`), whose
alternatives are each parameter not yet in the set followed by the rule of the set with it, and the end where the
set holds every required one: 2^n rules of at most n alternatives, against n! orders. That is bounded by
ANY_ORDER_MAX parameters (256 rules); a tool with more is held to its schema's order (a grammar linear in the
parameters), still with the required ones present, no duplicates and no others, and a model that writes them in
another order is cut back to the schema's."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skulk.formats.tool_parsers.coerce import json_types

QWEN3_CODER, GLM45 = "qwen3_coder", "glm45"
"""Named as their parsers are (tool_parsers/)."""


@dataclass(frozen=True, slots=True)
class XmlShape:
    """One format's fixed text: `head` holds {name}, `key_open` {key}; `forbidden`, the closing tags a text value
    may not hold."""

    head: str
    key_open: str
    value_close: str
    tail: str
    forbidden: tuple[str, ...]


XML_STYLES: dict[str, XmlShape] = {
    QWEN3_CODER: XmlShape("<tool_call>\n<function={name}>\n", "<parameter={key}>\n", "\n</parameter>\n",
                          "</function>\n</tool_call>", ("</parameter>", "</function>", "</tool_call>")),
    GLM45: XmlShape("<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n",
                    "</tool_call>", ("</arg_value>", "</tool_call>")),
}


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _class(chars: Sequence[str]) -> str:
    return "".join("\\" + c if c in "\\]^-" else c for c in chars)


def text_without_ebnf(words: Sequence[str]) -> str:
    """EBNF of any text holding none of `words` (closing tags: each starts with `<` and has no other `<`). The text
    is split at each `<`: the piece after one may not start with a word's rest, so each piece walks the trie of
    the rests and leaves it (or ends) before completing one."""
    if not all(w.startswith("<") and "<" not in w[1:] and len(w) > 1 for w in words):
        raise ValueError(f"not closing tags: {words}")
    rests = {w[1:] for w in words}
    nodes = sorted({r[:k] for r in rests for k in range(len(r))})  # "" first: the piece's start
    name = {p: f"n{i}" for i, p in enumerate(nodes)}
    rules = ['root ::= [^<]* ("<" n0)*']
    for p in nodes:
        nexts = sorted({r[len(p)] for r in rests if r.startswith(p) and len(r) > len(p)})
        alts = ['""', f"[^<{_class(nexts)}] [^<]*"]
        alts += [f"{json.dumps(c)} {name[p + c]}" for c in nexts if p + c in name and p + c not in rests]
        rules.append(f"{name[p]} ::= " + " | ".join(alts))
    return "\n".join(rules)


def _with_defs(prop: Any, params: dict[str, Any]) -> Any:
    """A property's schema with the parameters' definitions beside it, so its local references still resolve."""
    if not isinstance(prop, dict):
        return prop
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params and k not in prop}
    return {**prop, **defs}


def _value(prop: Any, text: Any) -> Any:
    """A parameter's value as the template writes it (the module's docstring)."""
    import xgrammar as xgr

    if isinstance(prop, dict):
        options = prop.get("enum", [prop["const"]] if "const" in prop else None)
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            literals = [_literal(o) for o in options]
            return literals[0] if len(literals) == 1 else xgr.Grammar.union(*literals)
    kinds = json_types(prop)
    if not kinds or "string" in kinds:
        return text
    return xgr.Grammar.from_json_schema(json.dumps(prop), any_whitespace=False, strict_mode=True)


ANY_ORDER_MAX = 8
"""The most parameters a call may write in any order (2^n rules); a tool with more is held to its schema's."""
_STATE = "xml_call_written_"
"""The prefix of `_any_order`'s rules: a set of parameters written, as a bit mask."""
_PARTS = re.compile(r"root ::= \(\(([A-Za-z0-9_]+(?: [A-Za-z0-9_]+)*)\)\)")


def _one_call(tool: dict[str, Any], shape: XmlShape, text: Any) -> Any:
    import xgrammar as xgr

    params = tool.get("parameters") or {}
    props = params.get("properties") or {}
    required = [k for k in params.get("required") or [] if isinstance(k, str)]
    keys = list(dict.fromkeys([*props, *required]))
    entries = [xgr.Grammar.concat(_literal(shape.key_open.replace("{key}", key)),
                                  _value(_with_defs(props.get(key, {}), params), text), _literal(shape.value_close))
               for key in keys]
    head = shape.head.replace("{name}", tool["name"])
    needed = [key in required for key in keys]
    if 2 <= len(entries) <= ANY_ORDER_MAX and (call := _any_order(entries, needed, head, shape.tail)) is not None:
        return call
    parts = [e if need else xgr.Grammar.union(e, _literal("")) for e, need in zip(entries, needed, strict=True)]
    return xgr.Grammar.concat(_literal(head), *parts, _literal(shape.tail))


def _any_order(entries: Sequence[Any], needed: Sequence[bool], head: str, tail: str) -> Any:
    """`head`, the parameters (`entries`, one grammar each) in any order, each at most once, every `needed` one
    present, then `tail`. The entries are written side by side by xgrammar, which names each one's rules apart
    (its root becomes one rule of the concatenation's root); the rules of the sets written are added around them.
    None where that text is not as expected or not read back (the caller then keeps the schema's order)."""
    import xgrammar as xgr

    lines = str(xgr.Grammar.concat(*entries)).splitlines()
    roots = [line for line in lines if line.startswith("root ::=")]
    match = _PARTS.fullmatch(roots[0]) if len(roots) == 1 else None
    names = match.group(1).split() if match else []
    if len(names) != len(entries) or any(line.startswith(_STATE) for line in lines):
        return None
    rules = [line for line in lines if line and not line.startswith("root ::=")]
    rules += written_sets_ebnf(names, needed)
    rules.append(f"root ::= {json.dumps(head, ensure_ascii=False)} {_STATE}0 {json.dumps(tail, ensure_ascii=False)}")
    try:
        return xgr.Grammar.from_ebnf("\n".join(rules))
    except RuntimeError:  # xgrammar printed a rule its own reader does not take: the schema's order, then
        return None


def written_sets_ebnf(names: Sequence[str], needed: Sequence[bool]) -> list[str]:
    """The rules `{_STATE}{mask}`: with the parameters of `mask` written, any one not yet written (its rule in
    `names`) then the rule of the set with it, or the end once every needed one is in. The full set is never a
    rule: its only alternative would be the end."""
    full = (1 << len(names)) - 1
    need = sum(1 << i for i, n in enumerate(needed) if n)

    def then(mask: int) -> str:
        return "" if mask == full else f" {_STATE}{mask}"

    rules = []
    for mask in range(full):
        alts = ['""'] if mask & need == need else []
        alts += [f"{name}{then(mask | 1 << i)}" for i, name in enumerate(names) if not mask >> i & 1]
        rules.append(f"{_STATE}{mask} ::= " + " | ".join(alts))
    return rules


def xml_call_grammar(tools: Sequence[dict[str, Any]], style: str) -> Any:
    """One call to one of `tools` in the XML style `style` (XML_STYLES): the alternatives joined."""
    import xgrammar as xgr

    shape = XML_STYLES[style]
    text = xgr.Grammar.from_ebnf(text_without_ebnf(shape.forbidden))
    options = [_one_call(tool, shape, text) for tool in tools]
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)
