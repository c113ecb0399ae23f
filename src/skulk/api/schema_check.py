"""Every schema a request's decoding would be held to (a JSON response format, the parameters of a forced tool
call), checked on the API node before the request is admitted, so an uncompilable one is a 400 naming why on
every API, streamed or not, rather than a runner's 500 or an error in the middle of a stream.

Two steps: the references as pure checks (engines/schema_refs.py: local, resolvable, no recursion without a way
out), then the grammar library's own conversion in a helper process (engines/schema_compile.py) under a deadline
(`COMPILE_DEADLINE_S`; a conversion past it is killed with its process) and a grammar size bound
(`MAX_GRAMMAR_CHARS`): the runner's tokenizer-specific compile grows with that size (measured on a 32k-token
vocabulary: 180 KB of grammar 0.22 s, 6.5 MB 7.8 s). Verdicts are cached by schema, so a client that sends the
same schema every time pays the check once."""

from __future__ import annotations

import asyncio
import json
import logging
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

from skulk.engines.constrained import HERMES, ConstraintError, call_schema
from skulk.engines.schema_refs import ref_problem
from skulk.types.chat import ChatCompletionRequest, OutputConstraint
from skulk.types.errors import ApiError, ErrorCode

log = logging.getLogger(__name__)

MAX_GRAMMAR_CHARS = 256 * 1024
COMPILE_DEADLINE_S = 5.0
START_DEADLINE_S = 60.0
"""The helper's start (importing xgrammar and torch), allowed for once per process on a loaded machine."""
CACHED_VERDICTS = 256


def constraint_schema(constraint: OutputConstraint) -> dict[str, Any] | None:
    """The schema a runner compiles for the constraint (the call schema for a forced tool call); None for any
    JSON object."""
    if constraint.kind == "json":
        return constraint.json_schema
    try:
        return call_schema(constraint, HERMES)
    except ConstraintError:
        return None  # no offered tool: forced_tool refused the request already


class SchemaChecker:
    """The grammar library's verdict on schemas, from one helper process started on first use and restarted after
    a conversion that ran past its deadline. Blocking: callers run it off the event loop."""

    def __init__(self, deadline_s: float = COMPILE_DEADLINE_S, max_chars: int = MAX_GRAMMAR_CHARS) -> None:
        self.deadline_s, self.max_chars = deadline_s, max_chars
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()

    def problem(self, schema: Any) -> str | None:
        """Why the schema cannot be compiled (None when it can)."""
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        verdict = ref_problem(schema)
        if verdict is None:
            with self._lock:
                verdict = self._convert(key)
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > CACHED_VERDICTS:
                self._verdicts.popitem(last=False)
        return verdict

    def _convert(self, key: str) -> str | None:
        proc = self._started()
        assert proc.stdin is not None
        proc.stdin.write(f'{{"schema":{key}}}\n')
        proc.stdin.flush()
        line = self._line(proc, self.deadline_s)
        if line is None:
            self.close()
            return (f"the grammar library did not convert it within {self.deadline_s:g} s; simplify the schema "
                    "(fewer nested anyOf/oneOf branches)")
        answer = json.loads(line)
        if "error" in answer:
            return f"the grammar library cannot compile it: {answer['error']}"
        if answer["size"] > self.max_chars:
            return (f"its grammar is {answer['size']} characters, over the {self.max_chars} this node compiles; "
                    "simplify the schema (fewer nested anyOf/oneOf branches, fewer properties)")
        return None

    def _started(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", "skulk.engines.schema_compile"], text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            if self._line(self._proc, START_DEADLINE_S) is None:
                self.close()
                raise RuntimeError("the schema checker did not start")
        return self._proc

    @staticmethod
    def _line(proc: subprocess.Popen[str], deadline_s: float) -> str | None:
        """The helper's next line, or None when it wrote none within the deadline (or ended)."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
        return (proc.stdout.readline() or None) if ready else None

    def close(self) -> None:
        """End the helper (the next check starts another)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


CHECKER = SchemaChecker()


async def check_output_schema(request: ChatCompletionRequest) -> None:
    """A 400 naming why when the schema the request's decoding would be held to cannot be compiled. A helper that
    cannot start admits the request: its runner refuses an uncompilable schema with a 400 too, only later."""
    constraint = request.output_constraint()
    schema = constraint_schema(constraint) if constraint is not None else None
    if schema is None:
        return
    try:
        why = await asyncio.to_thread(CHECKER.problem, schema)
    except (RuntimeError, OSError) as exc:
        log.warning("schema not checked before admission (%s); its runner checks it", exc)
        return
    if why is not None:
        what = ("the forced tool call's schema (the tool's parameters)" if constraint is not None
                and constraint.kind == "tool_call" else "the output JSON schema (response_format, text.format or "
                "format)")
        raise ApiError(ErrorCode.invalid_request, f"{what} cannot be compiled for constrained decoding: {why}")
