"""A split's step schedule as pure data (issue 28): which rows a Pipeline's next micro-batch decodes, how a step
header carries them, and how many collectives a Tensor-parallel layer costs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from skulk.engines.torch.cache import MixedBatch, StepBatch
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.schedule import micro_batch
from skulk.engines.torch.wire import ALL_ROWS, Header, StepKind, WireError, decode_fixed, fixed_ints, parse
from skulk.models.demo import ensure_demo_model

pytestmark = pytest.mark.timeout(60)


def test_one_rank_or_nothing_busy_decodes_every_row() -> None:
    assert micro_batch([False] * 4, [True] * 4, 1) == (0, 4)
    assert micro_batch([False], [True], 2) == (0, 1)  # a single stream: the whole batch, as unpipelined


def test_micro_batches_split_the_decoding_rows_between_ranks() -> None:
    assert micro_batch([False] * 8, [True] * 8, 2) == (0, 4)
    busy = [True] * 4 + [False] * 4
    assert micro_batch(busy, [True] * 8, 2) == (4, 8)
    assert micro_batch([True] * 8, [True] * 8, 2) is None  # everything in flight: rank 0 waits for tokens
    assert micro_batch([False] * 7, [True] * 7, 3) == (0, 3)  # ceil(7 / 3)


def test_a_micro_batch_skips_prefilling_rows_and_stops_at_busy_ones() -> None:
    # rows 0-1 in flight, 2 prefilling, 3-4 idle decoding, 5 in flight, 6 idle
    busy = [True, True, False, False, False, True, False]
    decoding = [True, True, False, True, True, True, True]
    assert micro_batch(busy, decoding, 2) == (3, 5)  # starts at the first idle decoding row, stops at a busy one
    assert micro_batch([False, False, False], [True, False, False], 2) == (0, 1)  # never ends on a prefilling row
    assert micro_batch([False] * 3, [False] * 3, 2) is None


def test_the_rows_travel_in_the_fixed_header_and_are_checked() -> None:
    header = Header(StepKind.DECODE, rows=(4, 8))
    fixed = fixed_ints(header, b"")
    assert parse(fixed, lambda n: b"") == header
    plain = Header(StepKind.DECODE)
    assert fixed_ints(plain, b"")[-2:] == [0, ALL_ROWS]
    assert parse(fixed_ints(plain, b""), lambda n: b"") == plain
    for rows in [(5, 4), (-1, 2), (3, ALL_ROWS)]:
        with pytest.raises(WireError, match="decodes rows"):
            decode_fixed(int(StepKind.DECODE), 0, 0, rows)


class CountingAllReduce:
    """Threads standing for tensor-parallel ranks: each call is a real sum of the ranks' parts, and counted."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)
        self.calls = [0] * size

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.parts[rank] = x
            self.barrier.wait()
            total = torch.stack([p for p in self.parts if p is not None]).sum(0)
            self.barrier.wait()
            return total

        return all_reduce


def test_tensor_parallel_does_one_all_reduce_after_attention_and_one_after_the_mlp(tmp_path: Path) -> None:
    """The minimum for a row-split o_proj and down_proj: two collectives per layer, for a decode step, a prompt
    and a mixed step alike (embedding, norms and lm_head are replicated and cost none)."""
    demo = ensure_demo_model(tmp_path)
    reduce = CountingAllReduce(2)
    shards = [load_model(demo, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    layers = shards[0].args.num_hidden_layers

    def run(rank: int, batch: StepBatch | MixedBatch, ids: torch.Tensor) -> int:
        before = reduce.calls[rank]
        with torch.inference_mode():
            shards[rank](ids, batch, caches[rank])
        return reduce.calls[rank] - before

    caches = [s.make_cache(4, 16) for s in shards]
    prompt = StepBatch.build(torch.arange(6).unsqueeze(0), 0)
    decode = StepBatch.build(torch.tensor([[6]]), 0)
    mixed = MixedBatch((StepBatch.build(torch.tensor([[7]]), 0), StepBatch.build(torch.arange(3).unsqueeze(0), 1)))
    for batch, ids in [(prompt, torch.tensor([list(range(10, 16))])), (decode, torch.tensor([[3]])),
                       (mixed, torch.tensor([[4, 20, 21, 22]]))]:
        with ThreadPoolExecutor(2) as pool:
            counts = list(pool.map(lambda r, b=batch, i=ids: run(r, b, i), range(2)))
        assert counts == [2 * layers, 2 * layers]
