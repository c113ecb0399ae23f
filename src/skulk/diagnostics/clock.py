"""UTC timestamps as the wire writes them, and ages measured from them."""

from __future__ import annotations

from datetime import UTC, datetime


def utc_now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


def now_iso() -> str:
    """This moment as the wire writes it (what runners and supervisors stamp their milestones with)."""
    return iso(utc_now())


def parse_iso(text: str | None) -> datetime | None:
    """Lenient: a malformed timestamp from a peer must not break a diagnostics response."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def seconds_since(text: str | None, now: datetime) -> float:
    """Age of a timestamp in seconds, never negative (clocks of two processes may disagree slightly)."""
    moment = parse_iso(text)
    return max(0.0, (now - moment).total_seconds()) if moment else 0.0
