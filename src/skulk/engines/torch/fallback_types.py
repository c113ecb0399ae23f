"""transformers' table of causal-LM families, read from its source rather than imported: importing
transformers.models.auto imports torch (5 s), and the node process, which decides whether a card is accepted,
never loads torch. The table is a literal in modeling_auto.py (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); reading it
with `ast` takes about 40 ms and is done once per process."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

TABLE = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


@functools.cache
def causal_lm_classes() -> dict[str, str]:
    """model_type -> causal-LM class name, as the installed transformers maps them; {} where transformers is not
    installed or its table cannot be read (the fallback then claims nothing)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return {}
    source = Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == TABLE for t in node.targets):
            return _pairs(node.value)
    return {}


def _pairs(value: ast.expr) -> dict[str, str]:
    """The (model_type, class) pairs of `OrderedDict([...])`; {} for any other shape."""
    if not isinstance(value, ast.Call) or not value.args:
        return {}
    try:
        pairs = ast.literal_eval(value.args[0])
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in pairs if isinstance(v, str)}
