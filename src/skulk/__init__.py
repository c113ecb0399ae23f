"""Skulk: a distributed LLM inference cluster."""

__version__ = "0.1.0"
