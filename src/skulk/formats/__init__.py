"""Model files read with bounds: every length, count and offset a file states is checked against the file's size
and against a cap before anything is allocated, so a truncated or hostile GGUF, safetensors or config.json file
costs one clear `InvalidModelFile`, never an IndexError, a MemoryError or a node that stops answering.

The one home of these checks (issue 38): gguf_header.py walks a GGUF header, checkpoint.py reads safetensors
headers and config.json. Callers map InvalidModelFile to ErrorCode.invalid_model_file (400)."""

from __future__ import annotations

import os
from pathlib import Path


class InvalidModelFile(ValueError):
    """A model file that is malformed, truncated or states sizes beyond its own length or our caps; the message
    names the file and what is wrong with it."""


def read_capped(path: Path, cap: int, what: str) -> bytes:
    """The whole of a small file (a config, a header), refused before reading when it is larger than cap."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise InvalidModelFile(f"{path.name}: {what} is {size} bytes, more than the {cap} allowed")
            data = f.read(cap + 1)
    except OSError as exc:
        raise InvalidModelFile(f"{path.name}: cannot read {what}: {exc.strerror or exc}") from exc
    if len(data) > cap:  # grew since it was measured
        raise InvalidModelFile(f"{path.name}: {what} is more than the {cap} bytes allowed")
    return data
