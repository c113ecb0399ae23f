"""Multimodal rope (Qwen2.5-VL's M-RoPE): every position has three coordinates, temporal, height and width, and
ModelArgs.mrope_section says which rotary pairs each one turns (layers.Rope).

A text token's three coordinates are equal, so text alone rotates exactly as plain rope. An image's tokens (its
merged patches, row by row) sit at (start, start + row, start + column), and the text after it resumes at start +
max(rows, columns): from then on a token's position is its index plus a (negative) delta, in decode too.
transformers' Qwen2_5_VLModel.get_rope_index, for images, op for op.

The table is every rank's own: each computes it from the prompt's image runs (vision.image_spans) and the images'
grids, which travel with the request in the step header (header.NewRequest.grids), so a pipeline's later stages,
which never see the images, rotate their keys as rank 0 does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from skulk.engines.errors import PromptRejected

Grid = tuple[int, int, int]
"""An image's (temporal, rows, columns) of merged patches as the language model reads it: one token each."""


@dataclass(frozen=True, slots=True)
class MRope:
    """One prompt's rope positions: table [3, len(prompt)] (long, on the CPU), and the delta of every position
    after it (a generated token, a preempted request's appended tokens)."""

    table: torch.Tensor
    delta: int

    def rows(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start]: the positions of indices [start, end)."""
        n = self.table.shape[1]
        head = self.table[:, start:min(end, n)]
        if end <= n:
            return head
        tail = torch.arange(max(start, n), end) + self.delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)


def mrope_index(length: int, spans: Sequence[tuple[int, int]], grids: Sequence[Grid]) -> MRope | None:
    """The positions of a prompt of `length` tokens whose image runs are `spans`, the images' grids in order; None
    for a prompt without grids (text: plain rope). PromptRejected when a run is not its grid's size."""
    if not grids:
        return None
    if len(spans) != len(grids) or any(e - s != t * h * w for (s, e), (t, h, w) in zip(spans, grids, strict=False)):
        raise PromptRejected("the prompt's image placeholders do not match its images' grids")
    pieces: list[torch.Tensor] = []
    pos = at = 0
    for (start, end), (t, h, w) in zip(spans, grids, strict=True):
        pieces.append(torch.arange(start - at).expand(3, -1) + pos)
        pos += start - at
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack(grid).reshape(3, -1) + pos)
        pos, at = pos + max(h, w), end
    pieces.append(torch.arange(length - at).expand(3, -1) + pos)
    pos += length - at
    return MRope(torch.cat(pieces, dim=1), pos - length)


def rope_rows(parts: Sequence[tuple[MRope | None, int, int]], device: torch.device) -> torch.Tensor | None:
    """[3, B, T]: the rope positions of a batch whose row b holds indices [start, end) of a request (every row as
    long); None when no row has an image (the batch's own positions are its rope's)."""
    if all(m is None for m, _, _ in parts):
        return None
    rows = [m.rows(s, e) if m is not None else torch.arange(s, e).expand(3, -1) for m, s, e in parts]
    return torch.stack(rows, dim=1).to(device)
