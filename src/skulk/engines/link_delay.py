"""The emulated link latency's setting, apart from the torch engine that applies it (engines/torch/delay.py): the
node reads it too (worker/links.py adds it to the round trips it reports) and must not import torch."""

from __future__ import annotations

import os
from typing import Any

DELAY_ENV = "SKULK_LINK_DELAY_MS"
"""The one-way latency to emulate, in milliseconds (a round trip is twice it). Read once when a rank's link is set
up (the runner inherits its node's environment)."""


def emulated_delay_s(environ: Any = os.environ) -> float:
    """SKULK_LINK_DELAY_MS in seconds; 0 when unset, empty, malformed or negative (emulation off)."""
    try:
        value = float(environ.get(DELAY_ENV) or 0.0)
    except ValueError:
        return 0.0
    return value / 1000 if value > 0 else 0.0
