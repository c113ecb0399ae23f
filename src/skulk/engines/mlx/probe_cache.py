"""The MLX probe's answer, kept between a node's starts (issue 38).

The probe (engines/mlx/__init__.probed) runs a child interpreter that imports MLX and mlx-lm, computes once and
lists mlx-lm's model modules: 2.7 CPU-seconds, on the path of every start, since a node reports what it runs
(NodeGatheredInfo) only after it, and the master places nothing on a node it has no info from. After a full
restart on a busy two-core machine that made the nodes' first info, and so the first placement, seconds late.
The answer depends only on this machine, this interpreter, the installed MLX packages and the probe's own code,
so it is kept under those (a change of any asks again) and read back in microseconds. Only an answer that says
MLX computes is kept: a failure, perhaps a timeout under load, is asked again at the next start.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from skulk.models.families import MlxRegistry

PACKAGES = ("mlx", "mlx-lm", "mlx-metal", "mlx-cpu")
CODE = ("skulk.engines.mlx.registry", "skulk.models.families")


def key() -> str:
    """What the answer depends on: the host and its CPU, the interpreter, the MLX packages' versions and the
    source of the probe and of the registry's reader."""
    parts = [platform.node(), platform.machine(), platform.platform(), sys.executable, sys.version]
    for package in PACKAGES:
        try:
            parts.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package}=-")
    for module in CODE:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        parts.append(hashlib.sha256(Path(origin).read_bytes()).hexdigest() if origin else module)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def read(path: Path) -> MlxRegistry | None:
    """The kept registry when it was kept under this key, else None (a missing, foreign or damaged file)."""
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept, dict) or kept.get("key") != key():
            return None
        return MlxRegistry.from_json(kept["answer"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write(path: Path, answer: dict[str, Any]) -> None:
    """Keep the answer under this key (written whole: a node starting beside reads the old file or the new)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key(), "answer": answer}))
        os.replace(temporary, path)
