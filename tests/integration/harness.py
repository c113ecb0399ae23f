"""Helpers for integration tests: clusters of real node processes, and waiting on what they report.

They live in skulk.testing so benchmarks share them; this module keeps the tests' import path."""

from __future__ import annotations

from skulk.testing.cluster import Cluster, instance_ready, place, place_and_wait
from skulk.testing.waiting import wait_until

__all__ = ["Cluster", "instance_ready", "place", "place_and_wait", "wait_until"]
