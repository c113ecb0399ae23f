"""The torch engine's options: its keywords split into the three records it is built from (options.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.engines.torch.options import DEFAULT_MAX_BATCH, Pool, Shard, Weights, split_keywords

pytestmark = pytest.mark.timeout(30)


def test_each_keyword_lands_in_its_record() -> None:
    shard, pool, weights = split_keywords({"rank": 1, "world_size": 2, "kind": "tensor", "max_batch": 3,
                                           "kv_cache_bits": 8, "device": "cpu", "draft_dir": Path("d")})
    assert shard == Shard(rank=1, world_size=2, kind="tensor")
    assert pool == Pool(max_batch=3, kv_cache_bits=8)
    assert weights == Weights(device="cpu", draft_dir=Path("d"))
    assert shard.tensor and shard.is_sampler and not shard.is_scheduler


def test_no_keywords_are_the_defaults() -> None:
    shard, pool, weights = split_keywords({})
    assert (shard, pool, weights) == (Shard(), Pool(), Weights())
    assert pool.max_batch == DEFAULT_MAX_BATCH and shard.is_scheduler and shard.is_sampler and not shard.tensor


def test_a_pipeline_of_one_is_not_a_tensor_split() -> None:
    assert not Shard(kind="tensor", world_size=1).tensor
    assert not Shard(kind="pipeline", world_size=2).tensor


def test_an_unknown_keyword_is_refused() -> None:
    with pytest.raises(TypeError, match="max_batches"):
        split_keywords({"max_batches": 4})  # type: ignore[typeddict-unknown-key]


@pytest.mark.parametrize("field", ["max_batch", "prefill_chunk", "block_size"])
def test_a_pool_needs_room_for_one(field: str) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Pool(**{field: 0})
