"""Arguments coerced to the tool's JSON-schema types.

The XML formats (Qwen3-Coder's `<parameter=...>`, GLM-4.5's `<arg_value>`) write every value as text, and models
writing JSON now and then quote a number or a boolean: a value that is a string where the tool's schema asks for
an integer, number, boolean, null, object or array is read as that type when it reads cleanly ("3" -> 3, "true" ->
true, '{"a": 1}' -> {"a": 1}), and left as written otherwise (the client then sees what the model wrote)."""

from __future__ import annotations

import json
from typing import Any

_MISSING = object()


def json_types(schema: Any) -> list[str]:
    """The JSON types a property schema allows, in its order (`type` as a string or a list, or anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += json_types(sub)
    return out


def _as(kind: str, text: str) -> Any:
    """text read as one JSON type, or _MISSING where it does not read as that type."""
    word = text.strip()
    if kind == "boolean":
        return {"true": True, "false": False}.get(word.lower(), _MISSING)
    if kind == "null":
        return None if word.lower() in ("null", "none") else _MISSING
    try:
        value = json.loads(word)
    except ValueError:
        return _MISSING
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _MISSING
    if kind == "object":
        return value if isinstance(value, dict) else _MISSING
    if kind == "array":
        return value if isinstance(value, list) else _MISSING
    return _MISSING


def coerce_value(value: Any, schema: Any) -> Any:
    """One argument value to its schema's type (objects recursively); unchanged where nothing applies."""
    kinds = json_types(schema)
    if isinstance(value, str) and "string" not in kinds:
        for kind in kinds:
            read = _as(kind, value)
            if read is not _MISSING:
                value = read
                break
    if isinstance(value, dict) and isinstance(schema, dict):
        return coerce_arguments(value, schema)
    return value


def coerce_arguments(args: dict[str, Any], schema: Any) -> dict[str, Any]:
    """A call's arguments against the tool's `parameters` schema (an object schema with `properties`)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return args
    return {k: coerce_value(v, props[k]) if k in props else v for k, v in args.items()}
