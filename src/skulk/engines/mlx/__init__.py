"""The MLX engine: mlx-lm's own model implementations behind the runner's engine contract (engines/base.py).

Importing this package never imports MLX; `available()` says whether this machine can run the engine at all
(macOS arm64 with Metal, or Linux with `mlx[cpu]`), so a node without MLX wheels reports only torch.
"""

from __future__ import annotations

import functools
import logging
import platform
import sys

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


def is_metal() -> bool:
    """Apple silicon under macOS: MLX computes on the GPU (Metal)."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def install_hint() -> str:
    return INSTALL_HINT.get(sys.platform, "MLX has no wheels for this platform (macOS arm64 or Linux only)")
