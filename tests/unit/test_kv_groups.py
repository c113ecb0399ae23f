"""A hybrid model's two layer groups (Gemma 3: sliding-window layers beside global ones): each group its own block
pool and table, the sliding one holding only its window's blocks (engines/kv_pools.py, engines/torch/windows.py).

The engine tests run Gemma 3 1B's config scaled down (6 layers: 5 sliding, 1 global; window 16) with random
weights, blocks of 4 positions, prompts of several windows. Counted in blocks and tokens, never in time."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.kv_pools import group_pools, local_least, local_pool_blocks, split_pool, window_blocks
from skulk.engines.torch.blocks import NO_BLOCK, BlockAllocator, block_keys, blocks_for
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.windows import drop_behind, pack, unpack, window_hit
from skulk.engines.torch.wire import Header, Started, StepKind, decode_changes, encode_changes
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import SamplingParams
from tests.unit.test_paged_cache import drain

pytestmark = pytest.mark.timeout(120)

GEMMA = "google/gemma-3-1b-it"
SIZE = 4  # positions a block: the window (16) is 4 blocks
PROMPT = [(11 * i) % 400 + 3 for i in range(40)]  # 2.5 windows
GREEDY = SamplingParams(max_tokens=40, temperature=0)
SAMPLED = SamplingParams(max_tokens=40, temperature=1.0, seed=3)


# --- the pure parts ---------------------------------------------------------------------------------------------


def test_a_sliding_table_drops_only_blocks_wholly_behind_the_window_and_keeps_them_cached() -> None:
    pool = BlockAllocator(8, SIZE)
    table = [pool.allocate() for _ in range(6)]  # positions 0..23
    drop_behind(table, pool, 22, 16, SIZE)  # position 22 sees 7..22: block 0 (0..3) only is wholly behind
    assert table[:2] == [NO_BLOCK, 1]
    drop_behind(table, pool, 24, 16, SIZE)  # 9..24: blocks 0 and 1 behind
    assert table[:3] == [NO_BLOCK, NO_BLOCK, 2]
    assert (pool.held, pool.cached) == (4, 2)  # dropped blocks stay as cached prefix blocks
    drop_behind(table, pool, 24, 16, SIZE)
    assert pool.held == 4  # nothing twice


def test_a_prefix_hit_needs_the_blocks_of_the_window_its_next_token_sees() -> None:
    keys = block_keys(list(range(40)), SIZE)  # 10 whole blocks
    cached = {keys[i]: 100 + i for i in (0, 1, 5, 6, 7)}  # the sliding pool kept these
    # 8 blocks (32 positions): the next token (32) sees 17..32, blocks 4..7: 4 is gone. 7 blocks (28): 13..28, 3..6:
    # 3 and 4 gone. 2 blocks (8 positions): blocks 0..1, both there.
    assert window_hit(cached.get, keys, 8, 16, SIZE) == (2, [100, 101])
    cached[keys[4]] = 104
    assert window_hit(cached.get, keys, 8, 16, SIZE) == (8, [NO_BLOCK] * 4 + [104, 105, 106, 107])
    assert window_hit(cached.get, keys, 0, 16, SIZE) == (0, [])
    assert window_hit({}.get, keys, 8, 16, SIZE) == (0, [])


def test_two_groups_travel_in_one_admission_of_the_step_header() -> None:
    flat = pack([3, 4, 5], [NO_BLOCK, 7, 8], 9)
    assert unpack(flat, copied=True) == ([3, 4, 5], [NO_BLOCK, 7, 8], 9)
    assert unpack(pack([3], [4], None), copied=False) == ([3], [4], None)
    with pytest.raises(ValueError, match="two groups"):
        unpack((1, 2, 3), copied=False)
    header = Header(StepKind.PREFILL, admits=(flat,), copies=((6, 2),))
    assert decode_changes(encode_changes(header), 1).admits == (flat,)  # NO_BLOCK entries survive the wire


def test_the_sliding_pool_takes_what_its_windows_need_and_the_rest_of_the_budget_goes_to_the_global_pool() -> None:
    cap = local_pool_blocks(1024, 32, 64, 512)  # Gemma 3's window, 64 streams
    assert cap == 64 * (window_blocks(1024, 32) + 1) + 16 + 1
    full_block, local_block = 5 * 8192, 29 * 8192  # Gemma 3 4B's layer counts, 8 KiB a layer a block here
    budget = 10 * cap * (full_block + local_block)
    full, local = split_pool(budget, full_block, local_block, cap, 10**9)
    assert local == cap
    assert full * full_block + local * local_block <= budget < (full + 1) * full_block + local * local_block
    assert full > 10 * cap  # a long context's global blocks, while the sliding pool stays at its windows
    assert split_pool(budget // 100, full_block, local_block, cap, 10**9)[0] == \
        split_pool(budget // 100, full_block, local_block, cap, 10**9)[1]  # a small budget: as many of each
    assert split_pool(budget, 0, local_block, cap, 10**6) == (10**6, cap)  # a rank with no global layer
    full, local = group_pools(0, (full_block // 32, local_block // 32), 32, 8192, 64, 1024, 512)
    assert (full, local) == (blocks_for(8193, 32), local_least(1024, 32, 512, 8192))  # never below one request


# --- the engine ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: this tiny model's steps are microseconds of arithmetic, which a second thread only spins
    around on a busy machine (8 s of CPU for the preemption test instead of 0.3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.unit.test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint

    root = tmp_path_factory.mktemp("gemma")
    demo = ensure_demo_model(root / "models")
    path = write_checkpoint(scaled_down(GEMMA, REAL_CONFIGS[GEMMA]), root / "gemma")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


@pytest.fixture(scope="module")
def cold(gemma: Path) -> dict[str, list[int]]:
    """The reference: each prompt alone, in blocks of the whole context (no window ever drops a block, no prefix is
    shared: a hit needs a whole block of 128)."""
    engine = paged(gemma, block_size=128)
    tokens: dict[str, list[int]] = {}
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, GREEDY)
        tokens |= drain(engine)
    return tokens


PROMPTS = {"a": PROMPT, "b": [*PROMPT, 7, 9, 11, 13, 15, 17, 19, 21, 23], "c": [*PROMPT, 7, 9, 11, 13, 15, 2, 4, 6]}


def paged(path: Path, **kwargs: Any) -> TorchEngine:
    """float32: a row's arithmetic is the same whatever its batch-mates, so tokens compare across schedules."""
    return TorchEngine(path, **({"max_seq": 128, "block_size": SIZE, "prefill_chunk": 8, "dtype": "float32"} | kwargs))


@pytest.mark.slow  # a real engine (and rank processes): `make test`, not the fast lane
def test_a_long_gemma_prompt_holds_only_its_windows_blocks_in_the_sliding_pool(gemma: Path,
                                                                              cold: dict[str, list[int]]) -> None:
    """Prompt and reply of 80 positions (5 windows): after each decode step the global pool holds every position's
    block, the sliding pool at most window_blocks(16, 4) = 5, and the tokens (greedy, seeded sampling, and greedy
    with prompt-lookup speculation writing drafts through both tables) are the contiguous cache's."""
    sampled = paged(gemma, block_size=128)
    sampled.add_request("a", PROMPT, SAMPLED)
    drawn = drain(sampled)["a"]
    runs = ((GREEDY, False, cold["a"]), (SAMPLED, False, drawn), (GREEDY, True, cold["a"]))
    for sampling, speculate, expected in runs:
        engine = paged(gemma, speculate=speculate)
        assert engine.local_window == 16 and engine.local_blocks is not None
        engine.add_request("a", PROMPT, sampling)
        tokens: list[int] = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step()]
            if engine._running and len(tokens) > 1 and not speculate:  # after a decode step
                req = engine._running[0]
                assert engine.blocks.held == len(req.table) == blocks_for(req.length, SIZE)
                assert engine.local_blocks.held == sum(b != NO_BLOCK for b in req.local) <= window_blocks(16, SIZE)
        assert tokens == expected, (sampling, speculate)
        usage = engine.kv_usage()  # what diagnostics show: both pools
        assert usage["kv_local_window"] == 16 and usage["kv_local_blocks"] == engine.local_blocks.num_blocks
        assert usage["kv_local_blocks_held"] == 0 and usage["kv_local_blocks_cached"] > 0


@pytest.mark.slow  # a real engine (and rank processes): `make test`, not the fast lane
def test_a_gemma_prefix_longer_than_the_window_is_shared_by_both_groups(gemma: Path,
                                                                        cold: dict[str, list[int]]) -> None:
    """A second prompt starting with the first's 40 tokens reuses them (its sliding table shares the last window's
    blocks, NO_BLOCK before them) and generates what it does alone; a third, arriving beside the second, shares its
    blocks too."""
    engine = paged(gemma)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    tokens = drain(engine)
    engine.add_request("b", PROMPTS["b"], GREEDY)
    engine.add_request("c", PROMPTS["c"], GREEDY)
    reused: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
        reused |= {e.request_id: e.reused_tokens for e in engine.take_events() if isinstance(e, Started)}
    assert tokens == cold
    assert reused["b"] >= 40 - SIZE and reused["c"] >= 40 - SIZE  # past the window: both groups served it


@pytest.mark.slow  # a real engine (and rank processes): `make test`, not the fast lane
def test_preempted_gemma_requests_resume_to_the_same_tokens(gemma: Path, cold: dict[str, list[int]]) -> None:
    """Pools of one request each (the least a budget gets: 33 global blocks, the sliding pool one chunk past a
    window): three requests queue and preempt each other, in both pools, and still generate what they do alone."""
    engine = paged(gemma, kv_cache_bytes=1)
    assert engine.blocks.num_blocks == blocks_for(129, SIZE)
    assert engine.local_blocks is not None and engine.local_blocks.num_blocks == local_least(16, SIZE, 8, 128)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, GREEDY)
    assert drain(engine) == cold
    assert engine.preemptions > 0
    assert engine.blocks.held == engine.local_blocks.held == 0


# --- placement ----------------------------------------------------------------------------------------------------


def test_placement_sizes_a_gemma_pool_by_each_groups_real_bytes() -> None:
    """Gemma 3 1B (26 layers, 22 sliding through 512 positions): each Pipeline rank's pool is its global layers'
    bytes for the pool's positions plus its sliding layers' for the windows' (local_cap), not every layer's for
    every position, as the previews show; and the engine, handed those bytes, makes the same split back."""
    from skulk.master.placement import preview_placements
    from skulk.master.shard_plan import (
        MAX_STREAMS,
        explicit_pool_tokens,
        group_bytes_per_token,
        kv_bytes_per_token,
        local_cap,
        plan_ring,
        pool_bytes,
    )
    from skulk.models.catalog import card_from_config
    from skulk.types.ids import NodeId
    from skulk.types.instances import InstanceMeta, Sharding
    from tests.unit.test_model_families import REAL_CONFIGS
    from tests.unit.test_placement import state

    card = card_from_config(GEMMA, REAL_CONFIGS[GEMMA], 2_000_000_000)
    assert card.sliding_window == 512 and len(card.sliding_layers) == 22 and 5 not in card.sliding_layers
    cap = local_cap(card)
    assert cap == local_pool_blocks(512, 32, MAX_STREAMS, 512) * 32
    context = card.context_length
    plans = plan_ring(card, Sharding.Pipeline, [NodeId("a"), NodeId("b")], [64 << 30, 64 << 30])
    tokens = None
    for plan in plans:
        full, local = group_bytes_per_token(card, plan.start_layer, plan.end_layer)
        assert full + local == kv_bytes_per_token(card, plan.end_layer - plan.start_layer)
        tokens = (plan.kv_pool - cap * local) // full
        assert plan.kv_pool == tokens * full + cap * local < tokens * (full + local)
        blocks, local_blocks = group_pools(plan.kv_pool, (full, local), 32, context, MAX_STREAMS, 512, 512)
        assert (blocks, local_blocks * 32) == (tokens // 32, cap)
    assert tokens is not None and tokens >= context
    previews = preview_placements(state({"a": 64 << 30, "b": 64 << 30}), card, Sharding.Pipeline,
                                  InstanceMeta.MlxRing)
    shown = next(p for p in previews if len(p.nodes) == 2 and p.error is None)
    assert [n.kv_pool.in_bytes for n in shown.nodes] == [plan.kv_pool for plan in plans]
    assert explicit_pool_tokens(card, pool_bytes(card, 0, card.n_layers, context)) == context
    assert explicit_pool_tokens(card, pool_bytes(card, 0, card.n_layers, 4 * context)) == 4 * context
    mistral = card_from_config("mistralai/Mistral-7B-v0.1", REAL_CONFIGS["mistralai/Mistral-7B-v0.1"], 1)
    assert local_cap(mistral) == 0 and group_bytes_per_token(mistral, 0, 32)[1] == 0  # every layer slides: one group


@pytest.mark.slow  # a real engine (and rank processes): `make test`, not the fast lane
def test_two_tensor_ranks_keep_identical_sliding_tables(gemma: Path, tmp_path: Path) -> None:
    """Gemma with 2 KV heads split over 2 Tensor ranks (float32: the split's partial sums round like one rank's
    at this size): each rank holds every layer's half of the heads in both pools, through the same two tables per
    request, and the two requests (the second sharing the first's 40-token prompt) give one rank's tokens."""
    from skulk.testing.nodes import free_port
    from tests.unit.rank_jobs import launch
    from tests.unit.test_model_families import write_checkpoint

    wide = tmp_path / "gemma-kv2"
    shutil.copytree(gemma, wide)  # the tokenizer; the weights are rewritten
    config = json.loads((gemma / "config.json").read_text())
    assert config["num_attention_heads"] % 2 == 0
    config["num_key_value_heads"] = 2
    write_checkpoint(config, wide)
    prompts = [PROMPTS["a"], PROMPTS["b"]]
    engine = paged(wide, speculate=False)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    expected = drain(engine)
    port, out = free_port(), tmp_path / "tensor.json"
    launch("mixed_rank.py", [{"model": str(wide), "rank": rank, "port": port, "layers": [[0, 6], [0, 6]],
                              "kind": "tensor", "engines": ["torch", "torch"], "prompts": prompts,
                              "tokens": GREEDY.max_tokens, "out": str(out), "max_seq": 128, "block_size": SIZE,
                              "dtype": "float32", "share_prefixes": True} for rank in range(2)], 100)
    assert json.loads(out.read_text())["tokens"] == expected


@pytest.mark.slow  # a real engine (and rank processes): `make test`, not the fast lane
def test_two_pipeline_ranks_keep_identical_sliding_tables(gemma: Path, tmp_path: Path) -> None:
    """Rank 0 holds only sliding layers (0-2: its global pool costs it nothing), rank 1 the global layer 5 among
    sliding ones: both follow rank 0's headers (micro-batched: rank 0 runs a step ahead) into the same two tables
    per request, so two requests, the second sharing the first's 40-token prompt, give one rank's tokens."""
    from skulk.testing.nodes import free_port
    from tests.unit.rank_jobs import launch

    prompts = [PROMPTS["a"], PROMPTS["b"]]
    engine = TorchEngine(gemma, max_seq=128, block_size=SIZE, prefill_chunk=8, speculate=False)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    expected = drain(engine)
    port, out = free_port(), tmp_path / "pipeline.json"
    launch("mixed_rank.py", [{"model": str(gemma), "rank": rank, "port": port, "layers": [[0, 3], [3, 6]],
                              "engines": ["torch", "torch"], "prompts": prompts, "tokens": GREEDY.max_tokens,
                              "out": str(out), "max_seq": 128, "block_size": SIZE, "share_prefixes": True}
                             for rank in range(2)], 100)
    assert json.loads(out.read_text())["tokens"] == expected
