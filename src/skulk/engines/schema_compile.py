"""The grammar library's own verdict on a JSON schema, in a process of its own (`python -m
skulk.engines.schema_compile`): one JSON line in (`{"schema": ...}`), one out (`{"size": <grammar chars>}` or
`{"error": <why>}`).

Why a process: the API node checks every schema before it admits a request (api/schema_check.py), and xgrammar
brings torch with it (about 260 MB and 1.6 s to import), which the node process does not otherwise load; and a
schema whose conversion runs away can only be stopped by killing the process that converts it. The conversion here
is xgrammar's `Grammar.from_json_schema`, the step a runner's compile (engines/constrained.py) starts with, with the
same options, so what passes here converts there; its size (the grammar's EBNF text) is what the runner's
tokenizer-specific compile grows with."""

from __future__ import annotations

import json
import sys
from typing import Any


def grammar_size(schema: Any) -> dict[str, Any]:
    """{"size": n} for a schema xgrammar converts (n: its grammar's EBNF length), else {"error": its reason}."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        return {"error": _reason(str(exc))}
    return {"size": len(str(grammar))}


def _reason(text: str) -> str:
    """xgrammar's message without its C++ source prefix (`[08:30:41] /project/cpp/x.cc:3562: `)."""
    line = text.strip().splitlines()[0] if text.strip() else "the grammar library refused it"
    _, sep, tail = line.partition(".cc:")
    return tail.partition(": ")[2] or line if sep else line


def main() -> None:
    import xgrammar  # noqa: F401 - loaded before the ready line, so a first schema's deadline is its own

    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(grammar_size(json.loads(line)["schema"])) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
