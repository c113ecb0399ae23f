"""Helpers for tests and benchmarks that start real nodes on loopback."""
