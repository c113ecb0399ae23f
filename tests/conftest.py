"""Fixtures for every test directory."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def root_log_filters_kept() -> Iterator[None]:
    """A test that runs `skulk.cli.main` in-process installs the node's log rate limiter and scrubber on every root
    handler, pytest's own capture handlers included, which live for the whole session: later tests in the same
    worker then lost log records (the limiter's 20 of a kind per 10 s) and their caplog assertions failed only in
    the full suite. Each test's additions are taken off again."""
    saved = {handler: list(handler.filters) for handler in logging.getLogger().handlers}
    yield
    for handler, filters in saved.items():
        handler.filters[:] = filters
