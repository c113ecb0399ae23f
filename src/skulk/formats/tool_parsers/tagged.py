"""The formats that wrap each call in `<tool_call>` … `</tool_call>`, each with its own body:

- Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` (JSON);
- Qwen3-Coder: `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`;
- GLM-4.5 / 4.6: `<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>`.

Any number of calls; text before the first is content. Each format reads its own body first and the other two
after it, so a model whose template is not on the API node (picked by family name) is still read."""

from __future__ import annotations

import re
from collections.abc import Callable

from skulk.formats.tool_parsers.base import RawCall, all_or_none, before, json_call, loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)
_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

_NAME = re.compile(r"[\w.:-]+")

Body = Callable[[str], "RawCall | None"]


def _pairs(pattern: re.Pattern[str], body: str) -> list[tuple[str, str]] | None:
    """Every (key, value) the pattern reads back to back over the whole body; None if anything else is there."""
    out, at = [], 0
    while at < len(body):
        m = pattern.match(body, at)
        if m is None or m.end() == at:
            return None if body[at:].strip() else out
        out.append((m.group(1).strip(), m.group(2)))
        at = m.end()
    return out


def hermes_body(body: str) -> RawCall | None:
    return json_call(loads(body.strip()))


def _one_newline_off(value: str) -> str:
    """Qwen3-Coder's template writes a newline after `<parameter=k>` and before `</parameter>`: not the value's."""
    return value.removeprefix("\n").removesuffix("\n")


def qwen3_coder_body(body: str) -> RawCall | None:
    m = _FUNCTION.fullmatch(body)
    params = _pairs(_PARAMETER, m.group(2)) if m is not None else None
    if m is None or params is None:
        return None
    return m.group(1).strip(), {k: _one_newline_off(v) for k, v in params}


def glm45_body(body: str) -> RawCall | None:
    at = body.find("<arg_key>")
    name = (body if at < 0 else body[:at]).strip()
    args = _pairs(_ARG, body[at:]) if at >= 0 else []
    if not _NAME.fullmatch(name) or args is None:
        return None
    return name, dict(args)


def tagged_split(*bodies: Body) -> Callable[[str], tuple[str, list[RawCall]] | None]:
    """A `split` for `<tool_call>` formats that reads each body with the first of `bodies` that reads it."""

    def read(body: str) -> RawCall | None:
        return next((c for c in (b(body) for b in bodies) if c is not None), None)

    def split(text: str) -> tuple[str, list[RawCall]] | None:
        found = before(text, (OPEN,))
        if found is None:
            return None
        calls = all_or_none([read(b) for b in _CALL.findall(found[1])])
        return (found[0].strip(), calls) if calls is not None else None

    return split


hermes_split = tagged_split(hermes_body, qwen3_coder_body, glm45_body)
qwen3_coder_split = tagged_split(qwen3_coder_body, hermes_body, glm45_body)
glm45_split = tagged_split(glm45_body, hermes_body, qwen3_coder_body)
