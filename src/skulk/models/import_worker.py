"""POST /models/import's work in a child process, under a memory and time budget.

An import reads the file's metadata with transformers, which turns every metadata string into Python objects
byte by byte while holding the GIL: in a thread of the node a hostile file froze its event loop for seconds at a
time (the master dropped the node) and took gigabytes. In a child the node's loop never waits on it, the child's
memory is watched (killed past IMPORT_MEMORY_BUDGET) and its time bounded (IMPORT_TIMEOUT_S), and whatever the
file does costs one clear answer. The header is walked with bounds first (skulk.formats.gguf_header), so a
hostile header is refused in the child's first second, before transformers or torch are imported.

The child reads one JSON request on stdin and writes one JSON answer on stdout: {"card": ...} or
{"code": ..., "message": ...}; anything else (a crash, a kill) is the parent's to name.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil

from skulk.types.errors import ApiError, ErrorCode
from skulk.types.models import ModelCard

IMPORT_MEMORY_BUDGET = 4 << 30
"""Resident bytes an import may use: torch and transformers (~0.5 GB) and a 262k-token vocabulary's tokenizer
build (~1 GB) fit with room; a file that needs more is refused, not allowed to starve the node."""
IMPORT_TIMEOUT_S = 600.0
"""A real import (header, tokenizer, config) takes seconds to a minute on a slow machine."""
POLL_S = 0.1


async def import_in_child(source: str, models_dir: Path, model_id: str | None, *,
                          memory_budget: int = IMPORT_MEMORY_BUDGET,
                          timeout_s: float = IMPORT_TIMEOUT_S, ollama_models: str | None = None) -> ModelCard:
    """The card of the imported model; ApiError (invalid_model_file, unsupported_architecture: 400) naming what
    is wrong with the file, or internal_error when the child failed for another reason. ollama_models: the
    Ollama store an `ollama:` source is looked up in (the CLI's OLLAMA_MODELS), as the child's OLLAMA_MODELS."""
    request = json.dumps({"source": source, "models_dir": str(models_dir), "model_id": model_id}).encode()
    env = {**os.environ, "OLLAMA_MODELS": ollama_models} if ollama_models else None
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skulk.models.import_worker", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    watch = asyncio.create_task(_watch_memory(proc, memory_budget))
    try:
        out, err = await asyncio.wait_for(proc.communicate(request), timeout_s)
    except TimeoutError:
        raise ApiError(ErrorCode.invalid_model_file,
                       f"{source}: the import took longer than {timeout_s:.0f} s and was stopped") from None
    finally:
        watch.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    peak = watch.result() if watch.done() and not watch.cancelled() else None
    if peak is not None:
        raise ApiError(ErrorCode.invalid_model_file,
                       f"{source}: the import needed more than {memory_budget >> 20} MiB of memory "
                       f"({peak >> 20} MiB when stopped); the file's metadata is too large to import")
    return _answer(out, err, proc.returncode)


async def _watch_memory(proc: asyncio.subprocess.Process, budget: int) -> int | None:
    """Kill the child once its resident memory passes the budget, and say how much it had then."""
    try:
        child = psutil.Process(proc.pid)
        while proc.returncode is None:
            rss = int(child.memory_info().rss)
            if rss > budget:
                proc.kill()
                return rss
            await asyncio.sleep(POLL_S)
    except psutil.Error:  # it ended between two looks
        return None
    return None


def _answer(out: bytes, err: bytes, returncode: int | None) -> ModelCard:
    try:
        answer: dict[str, Any] = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {returncode}"]
        raise ApiError(ErrorCode.internal_error, f"the import process failed: {last[0][:500]}") from None
    if "card" in answer:
        return ModelCard.model_validate(answer["card"])
    raise ApiError(ErrorCode(answer["code"]), str(answer["message"]))


def run(request: dict[str, Any]) -> dict[str, Any]:
    """The child's work: import_source, its refusals as (code, message)."""
    from skulk.models.catalog import UnsupportedArchitecture
    from skulk.models.gguf_import import import_source

    try:
        card = import_source(str(request["source"]), Path(request["models_dir"]), request.get("model_id"))
    except UnsupportedArchitecture as exc:
        return {"code": ErrorCode.unsupported_architecture.value, "message": str(exc)}
    except ValueError as exc:  # InvalidModelFile, NotGGUF, OllamaModelNotFound: the source, named
        return {"code": ErrorCode.invalid_model_file.value, "message": str(exc)}
    return {"card": card.model_dump(mode="json")}


def main() -> None:
    answer = run(json.loads(sys.stdin.buffer.read()))
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
