"""The web dashboard's files: plain ES modules and small vendored libraries, shipped as package data and served
by `skulk.api.dashboard`. No build step: what is in static/ is what the browser runs."""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
