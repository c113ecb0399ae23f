"""The start-up "Try: curl" line works as printed: the default model's chat, how to place one with
--no-place-default (a chat would 404), the Authorization header with --api-key (a bare curl would 401)."""

from __future__ import annotations

import json
import re

from skulk.announce import try_line
from skulk.config import Settings


def body_of(line: str) -> dict[str, object]:
    match = re.search(r"-d '(.*)'$", line)
    assert match is not None, line
    return json.loads(match.group(1))


def test_the_default_start_asks_the_default_model() -> None:
    settings = Settings()
    line = try_line(settings, 52415)
    assert line.startswith("Try: curl localhost:52415/v1/chat/completions -H 'Content-Type: application/json'")
    assert body_of(line)["model"] == settings.default_model and "Authorization" not in line


def test_with_no_place_default_it_says_how_to_place_instead_of_a_chat_that_404s() -> None:
    line = try_line(Settings(place_default=False), 52415)
    assert "/v1/chat/completions" not in line and "localhost:52415/v1/models" in line
    assert "--no-place-default" in line and "/place_instance" in line


def test_with_api_keys_the_line_carries_the_header_but_never_the_key() -> None:
    for settings in (Settings(api_keys=["sk-secret"]), Settings(admin_keys=["sk-secret"], place_default=False)):
        line = try_line(settings, 52415)
        assert '-H "Authorization: Bearer $SKULK_API_KEY"' in line and "sk-secret" not in line
    assert body_of(try_line(Settings(api_keys=["k"]), 1))["messages"]
