"""Byte quantities as the wire writes them: {"inBytes": n}."""

from __future__ import annotations

from .base import CamelModel

GB = 1024**3


class Memory(CamelModel):
    in_bytes: int = 0

    @classmethod
    def from_bytes(cls, n: int) -> Memory:
        return cls(in_bytes=int(n))

    @classmethod
    def from_gb(cls, gb: float) -> Memory:
        return cls(in_bytes=int(gb * GB))

    @property
    def in_gb(self) -> float:
        return self.in_bytes / GB

    def __add__(self, other: Memory) -> Memory:
        return Memory(in_bytes=self.in_bytes + other.in_bytes)

    def __sub__(self, other: Memory) -> Memory:
        return Memory(in_bytes=self.in_bytes - other.in_bytes)
