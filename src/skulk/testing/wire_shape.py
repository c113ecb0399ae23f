"""Field-for-field comparison of a response with a recorded one: same keys, same JSON types, recursively.

Recorded responses are written from another server's public API types (tests/integration/skulk_wire/), so a
client written for that server reads ours unchanged. Conventions in a recorded document:
- an object whose only key is "<any>" is a map with arbitrary keys (node ids): each of ours must match its value;
- a list's first element is the shape of every element of ours (an empty recorded list accepts any list);
- an object with the key "<extra_ok>" lets ours carry keys it does not list (fields Skulk clients never read);
- a string like "<number|null>" is a type: any of the listed JSON kinds (optional readings);
- ints and floats are both numbers; a recorded null accepts only null.
"""

from __future__ import annotations

from typing import Any

ANY_KEY = "<any>"
EXTRA_OK = "<extra_ok>"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def shape_mismatches(recorded: Any, ours: Any, where: str = "$", *, extra_ok: bool = False) -> list[str]:
    """Every place where ours differs from the recorded shape, as 'path: what' lines (empty: same shape).
    extra_ok lets ours carry keys the recorded top-level object does not have (never deeper)."""
    if isinstance(recorded, str) and recorded.startswith("<") and recorded.endswith(">"):
        kinds = recorded[1:-1].split("|")
        return [] if _kind(ours) in kinds else [f"{where}: expected {recorded}, got {_kind(ours)} ({ours!r:.80})"]
    if _kind(recorded) != _kind(ours):
        return [f"{where}: expected {_kind(recorded)}, got {_kind(ours)} ({ours!r:.80})"]
    if isinstance(recorded, list):
        if not recorded:
            return []
        return [m for i, item in enumerate(ours) for m in shape_mismatches(recorded[0], item, f"{where}[{i}]")]
    if not isinstance(recorded, dict):
        return []
    if list(recorded) == [ANY_KEY]:
        return [m for k, v in ours.items() for m in shape_mismatches(recorded[ANY_KEY], v, f"{where}.{k}")]
    extra_ok = extra_ok or bool(recorded.get(EXTRA_OK))
    recorded = {k: v for k, v in recorded.items() if k != EXTRA_OK}
    problems = [f"{where}.{k}: missing" for k in recorded if k not in ours]
    if not extra_ok:
        problems += [f"{where}.{k}: not in the recorded shape" for k in ours if k not in recorded]
    return problems + [m for k in recorded if k in ours for m in shape_mismatches(recorded[k], ours[k], f"{where}.{k}")]
