"""The MLX engine: mlx-lm's own model implementations behind the runner's engine contract (engines/base.py).

Importing this package never imports MLX; `available()` says whether this process can run the engine (a
runner), `probe()` asks a child interpreter (the node, which keeps MLX out of its own memory as it keeps torch
out), so a node without MLX wheels, or with a wheel that cannot compute here, reports only torch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import platform
import subprocess
import sys
from pathlib import Path

from skulk.engines.mlx import probe_cache
from skulk.models.families import MlxRegistry

log = logging.getLogger("skulk.engines.mlx")

INSTALL_HINT = {
    "darwin": "pip install mlx mlx-lm",
    "linux": "pip install 'mlx[cpu]' mlx-lm",
}


@functools.cache
def available() -> str | None:
    """None when MLX and mlx-lm import and MLX can compute here; otherwise why not (logged once per process)."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401

        mx.eval(mx.array([1.0]) + 1)
    except Exception as exc:  # ImportError, or a wheel whose backend cannot run on this machine
        reason = f"{type(exc).__name__}: {exc}"
        log.info("the MLX engine is not available on this node (%s); it runs torch only. To add it: %s",
                 reason, install_hint())
        return reason
    return None


PROBE = [sys.executable, "-m", "skulk.engines.mlx.registry"]
"""The probe's child: MLX computes here, and it prints mlx-lm's model registry (registry.py)."""
PROBE_TIMEOUT_S = 60.0
PROBE_CACHE = Path("~/.skulk/cache/mlx-probe.json").expanduser()
"""A successful probe's answer, kept for the next start of any node of this user on this machine and Python
(probe_cache.py says what it is keyed by); a failure is never kept, so a timeout under load is asked again."""


@functools.cache
def probed() -> tuple[str | None, MlxRegistry | None]:
    """available(), answered by a child interpreter: (None, mlx-lm's model registry) when MLX computes here,
    else (why not, None), logged once. The node starts it once; the catalog reads the registry from it."""
    registry = None
    if importlib.util.find_spec("mlx") is None or importlib.util.find_spec("mlx_lm") is None:
        reason: str | None = "mlx and mlx-lm are not installed"
    elif (registry := probe_cache.read(PROBE_CACHE)) is not None:
        reason = None
    else:
        try:
            run = subprocess.run(PROBE, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
            reason = None if run.returncode == 0 else (run.stderr.strip().splitlines() or ["exit"])[-1][:200]
            if reason is None:
                answer = json.loads(run.stdout.strip().splitlines()[-1])
                registry = MlxRegistry.from_json(answer)
                probe_cache.write(PROBE_CACHE, answer)
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        log.info("the MLX engine is not available on this node (%s); it runs torch only. To add it: %s",
                 reason, install_hint())
    return reason, registry


def probe() -> str | None:
    """None when MLX computes here (a child interpreter says so), else why not."""
    return probed()[0]


def model_registry() -> MlxRegistry | None:
    """mlx-lm's model registry where the MLX engine runs here (None: it does not, so it claims no family)."""
    return probed()[1]


def is_metal() -> bool:
    """Apple silicon under macOS: MLX computes on the GPU (Metal)."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def install_hint() -> str:
    return INSTALL_HINT.get(sys.platform, "MLX has no wheels for this platform (macOS arm64 or Linux only)")
