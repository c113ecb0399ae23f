"""The API-side event log: every event and token chunk this node's API sees, on disk, bounded (runbook 004)."""

from skulk.eventlog.log import EventLog, Limits, open_for

__all__ = ["EventLog", "Limits", "open_for"]
