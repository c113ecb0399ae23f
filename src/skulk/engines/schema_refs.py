"""What a JSON schema's `$ref`s must be before it becomes a grammar, as pure functions: local (`#` or a JSON
pointer `#/...`), pointing at something, and never a recursion that every value must take again.

The grammar library (xgrammar) refuses a dangling pointer and a cycle with no content (a -> b -> a) with a bare
RuntimeError, but quietly accepts three shapes that cannot mean what they say: a remote or relative reference
(`http://...`, `other.json`, `#anchor`: it warns and treats it as any value), a malformed pointer, and a recursion
whose every path is mandatory (an object that requires a property of its own type): a grammar with no finite
string, so a constrained reply could only end at max_tokens. A recursive schema with a way out is legitimate
and kept: a tree whose children are optional or an array that may be empty.

`rebased` moves a schema's local references under a prefix, for a tool's parameters placed inside the call
schema (engines/constrained.py `call_schema`), so `#/$defs/x` still points into the parameters."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose values are JSON data, not schemas: a `$ref` in them is a string like any other."""
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas (a property may be called `enum` or `$ref`)."""


def refs(schema: Any, where: str = "#") -> Iterator[tuple[str, str]]:
    """Each `$ref` in a schema, with where it is (a JSON pointer into the schema)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from refs(item, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        here = f"{where}/{_escape(key)}"
        if key == "$ref" and isinstance(value, str):
            yield here, value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from refs(sub, f"{here}/{_escape(name)}")
        elif key not in DATA_KEYS:
            yield from refs(value, here)


def resolve(root: Any, ref: str) -> tuple[Any, str | None]:
    """(the schema `ref` points at, None), or (None, why it points at none)."""
    if ref == "#":
        return root, None
    if not ref.startswith("#/"):
        return None, ("is not a local reference (# or #/...): remote, relative and anchor references are not "
                      "fetched; put the schema under $defs and point at it")
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None, f"points at nothing: there is no {part!r} there"
    if not isinstance(node, dict | bool):
        return None, "points at a value that is not a schema"
    return node, None


def ref_problem(schema: Any) -> str | None:
    """Why the schema's references cannot be compiled, naming the reference; None when they can."""
    found = list(refs(schema))
    for where, ref in found:
        _, why = resolve(schema, ref)
        if why is not None:
            return f"$ref {ref!r} at {where[1:] or '/'} {why}"
    finite = _finite_refs(schema, {ref for _, ref in found})
    endless = sorted(ref for ref, ok in finite.items() if not ok)
    if endless:
        return (f"$ref {endless[0]!r} has no finite value: every value of it must contain itself again (a cycle of "
                "references with nothing else, or a required property of its own type); make the recursion "
                "optional (a property that is not required, or an array that may be empty)")
    return None


def _finite_refs(root: Any, targets: set[str]) -> dict[str, bool]:
    """For each reference, whether some finite value matches it: the least fixpoint (every reference assumed
    endless until a finite value is found for it)."""
    finite = dict.fromkeys(targets, False)
    changed = True
    while changed:
        changed = False
        for ref in targets:
            if not finite[ref] and _finite(resolve(root, ref)[0], finite, 0):
                finite[ref] = changed = True
    return finite


def _finite(node: Any, finite: dict[str, bool], depth: int) -> bool:
    """Whether a finite value matches `node`, given which references have one. Only what a value must hold is
    followed: $ref, allOf, a branch of anyOf/oneOf, required properties, the first minItems items."""
    if not isinstance(node, dict) or depth > 200:
        return True
    must: list[Any] = list(node.get("allOf") or [])
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_finite(b, finite, depth + 1) for b in branches):
            return False
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        must += [props[name] for name in required if isinstance(name, str) and name in props]
    least = node.get("minItems")
    if isinstance(least, int) and least > 0:
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        must += prefix[:least]
        if least > len(prefix):
            must.append(node.get("items"))
    return all(_finite(m, finite, depth + 1) for m in must)


def rebased(schema: Any, prefix: str) -> Any:
    """The schema with each local `$ref` (# or #/...) moved under `prefix` (a JSON pointer such as
    /properties/arguments), for the schema placed at that pointer inside another."""
    if isinstance(schema, list):
        return [rebased(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + prefix + value[1:]
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rebased(sub, prefix) for name, sub in value.items()}
        elif key in DATA_KEYS:
            out[key] = value
        else:
            out[key] = rebased(value, prefix)
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
