"""Secrets never leave the node (issue 27): not in a diagnostics bundle, a log line, a trace or the dashboard.

Two nets. By shape: a command line's value after a flag that names a key, token, secret or password
(`--cluster-key K`, `--admin-key=K`, `SKULK_API_KEYS=K`) is replaced, whatever the value. By value: the node
registers the secrets it was started with (cluster key, API and admin keys, Hugging Face token), and every log
record and every diagnostics text passes through `scrub`, which replaces any of them wherever it appears (a
secret echoed in an error message, a URL, a traceback). An HTTP admin key must not yield the cluster key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

MASK = "***"
MIN_SECRET_CHARS = 4
"""Shorter values are not scrubbed by value (they would mangle ordinary text); flags still hide them."""
_SECRET_NAME = re.compile(r"(key|token|secret|password|passwd)s?$", re.IGNORECASE)
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_-]*)=(.+)$")

_secrets: tuple[str, ...] = ()


def register(values: Iterable[str | None]) -> None:
    """The secrets this process holds; longest first, so one that contains another is masked whole."""
    global _secrets
    found = {v for v in values if v and len(v) >= MIN_SECRET_CHARS}
    _secrets = tuple(sorted(found | set(_secrets), key=len, reverse=True))


def scrub(text: str) -> str:
    """`text` with every registered secret masked."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _names_secret(flag: str) -> bool:
    return bool(_SECRET_NAME.search(flag.lstrip("-").replace("-", "_")))


def command_line(parts: list[str]) -> list[str]:
    """A process's argv with the value of every secret-naming flag or assignment masked (pure, but for the
    registered values also scrubbed)."""
    out: list[str] = []
    hide_next = False
    for part in parts:
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        if part.startswith("-") and "=" in part:
            flag, _ = part.split("=", 1)
            out.append(f"{flag}={MASK}" if _names_secret(flag) else scrub(part))
        elif part.startswith("--") and _names_secret(part):
            out.append(part)
            hide_next = True
        elif (m := _ASSIGNMENT.match(part)) and _names_secret(m.group(1)):
            out.append(f"{m.group(1)}={MASK}")
        else:
            out.append(scrub(part))
    return out


class ScrubFilter(logging.Filter):
    """Masks registered secrets in every record a handler emits (the message as formatted, and its traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _secrets:
            return True
        message = record.getMessage()
        cleaned = scrub(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)
            if scrub(trace) != trace:  # the traceback goes into the message, masked; every formatter shows it
                record.msg = f"{record.getMessage()}\n{scrub(trace)}"
                record.args, record.exc_info, record.exc_text = None, None, None
        return True


def install_log_scrub() -> None:
    """On every handler of the root logger (the console, the structured file, the rate limiter's own)."""
    scrubber = ScrubFilter()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ScrubFilter) for f in handler.filters):
            handler.addFilter(scrubber)
