"""Forced tool calls in the two XML-tagged formats, written as their templates write a call and as their parsers
(formats/tool_parsers/tagged.py) read one back:

- Qwen3-Coder: `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>`;
- GLM-4.5: `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>value</arg_value>\\n...</tool_call>`.

Their templates write a string argument as its raw text and anything else as JSON (`tojson`), and the parsers
read every value as text and coerce it to the tool's schema type (tool_parsers/coerce.py). So the grammar, one
alternative per allowed tool, is: the function's name in fixed text; the schema's parameters in its order, the
required ones present, no others; a value whose schema allows a string (or says no type) as text that holds none
of the closing tags the parser's non-greedy matches stop at (else the call would be read cut short), one of the
strings where the schema is an enum of strings, and any other value as JSON of its schema (xgrammar's, no free
whitespace). What is not enforced: a string's own constraints (pattern, length, format), and closing tags
inside a JSON string nested in an object or array value."""

from __future__ import annotations

import json
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


def _one_call(tool: dict[str, Any], shape: XmlShape, text: Any) -> Any:
    import xgrammar as xgr

    params = tool.get("parameters") or {}
    props = params.get("properties") or {}
    required = [k for k in params.get("required") or [] if isinstance(k, str)]
    parts = [_literal(shape.head.replace("{name}", tool["name"]))]
    for key in [*props, *(k for k in required if k not in props)]:
        one = xgr.Grammar.concat(_literal(shape.key_open.replace("{key}", key)),
                                 _value(_with_defs(props.get(key, {}), params), text), _literal(shape.value_close))
        parts.append(one if key in required else xgr.Grammar.union(one, _literal("")))
    parts.append(_literal(shape.tail))
    return xgr.Grammar.concat(*parts)


def xml_call_grammar(tools: Sequence[dict[str, Any]], style: str) -> Any:
    """One call to one of `tools` in the XML style `style` (XML_STYLES): the alternatives joined."""
    import xgrammar as xgr

    shape = XML_STYLES[style]
    text = xgr.Grammar.from_ebnf(text_without_ebnf(shape.forbidden))
    options = [_one_call(tool, shape, text) for tool in tools]
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)
