"""`skulk --help` reads each default from `Settings` (defaults are written once) and names the other commands."""

from __future__ import annotations

from skulk.cli import build_parser
from skulk.config import Settings


def test_help_shows_the_settings_defaults_and_the_other_commands() -> None:
    text = " ".join(build_parser().format_help().split())
    defaults = Settings.model_fields
    assert f"SKULK_API_PORT, default {defaults['api_port'].default}" in text
    assert f"SKULK_MAX_CONNECTIONS, {defaults['max_connections'].default}" in text
    assert f"SKULK_DEFAULT_MODEL, {defaults['default_model'].default}" in text
    for command in ("skulk models", "skulk diag", "skulk keygen"):
        assert command in text
