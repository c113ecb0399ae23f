"""The paged KV cache: the block allocator's rules, and the engine on it (same tokens as the contiguous layout,
queueing when blocks run out, preemption that resumes to the same tokens, a shared prefix held once).

Counted in blocks and steps, never in time."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.engines.torch.blocks import BlockAllocator, OutOfBlocks, block_keys, blocks_for
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.schedule import pool_blocks
from skulk.engines.torch.timing import StepTimes
from skulk.engines.torch.wire import (
    NO_COPY,
    Admitted,
    Header,
    Started,
    StepKind,
    WireError,
    decode_changes,
    encode_changes,
)
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # runs real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=12, temperature=0)
TEXT = [*b"Paged attention keeps each request's keys and values in blocks of a shared pool. "] * 30


@pytest.fixture(autouse=True)
def fixed_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks beside running streams stay at the floor instead of following measured step times: the schedule,
    hence which path each chunk takes (the layer stack or torch's, whose int4 roundings differ), is the same in
    every engine of a comparison however loaded the machine is."""
    monkeypatch.setattr(StepTimes, "measure", lambda *_: None)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [258, *((w + salt) % 250 + 1 for w in TEXT)][:n]


def drain(engine: TorchEngine, tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    tokens = {} if tokens is None else tokens
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return tokens


def run(engine: TorchEngine, requests: dict[str, list[int]], sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for rid, ids in requests.items():
        engine.add_request(rid, ids, sampling)
    return drain(engine)


# --- the allocator ------------------------------------------------------------------------------------------


def test_allocate_takes_the_lowest_free_block_and_free_gives_it_back() -> None:
    pool = BlockAllocator(4, 16)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert (pool.available, pool.held) == (1, 3)
    pool.free(1, keep=False)
    assert pool.allocate() == 1  # freed blocks are reused, lowest first
    assert pool.allocate() == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    with pytest.raises(ValueError, match="not held"):
        BlockAllocator(2, 4).free(0, keep=False)


def test_a_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = BlockAllocator(4, 16)
    block = pool.allocate()
    pool.share(block)
    assert pool.refcount(block) == 2
    pool.free(block, keep=False)
    assert (pool.refcount(block), pool.held) == (1, 1)
    pool.free(block, keep=False)
    assert (pool.refcount(block), pool.held) == (0, 0)
    with pytest.raises(ValueError, match="nothing to share"):
        pool.share(block)  # free, not cached: there is nothing in it


def test_copy_on_write_copies_a_shared_block_and_writes_a_lone_one_in_place() -> None:
    pool = BlockAllocator(4, 16)
    block = pool.allocate()
    pool.cache_full(block, 7)
    assert pool.writable(block) == (block, None)  # held once: written in place, no longer the keyed prefix
    assert pool.match([7]) == []
    pool.share(block)
    copy, source = pool.writable(block)
    assert source == block and copy != block
    assert (pool.refcount(block), pool.refcount(copy)) == (1, 1)  # the writer moved to its copy


def test_cached_blocks_are_shared_by_key_and_evicted_least_recent_first() -> None:
    pool = BlockAllocator(4, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    keys = block_keys(tokens, 2)
    assert len(keys) == 3 and block_keys([1, 2, 9, 9], 2)[0] == keys[0] != block_keys([1, 2, 9, 9], 2)[1]
    table = [pool.allocate() for _ in range(3)]
    for block, key in zip(table, keys, strict=True):
        pool.cache_full(block, key)
    pool.free_table(table, kept=3)  # kept, tail first: the LRU order is table[2], table[1], table[0]
    assert (pool.cached, pool.held, pool.available) == (3, 0, 4)
    assert pool.match(keys) == table
    assert pool.match(block_keys([1, 2, 3, 9], 2)) == table[:1]  # stops where the tokens diverge
    assert pool.allocate() == 3  # a free block before any cached one
    assert pool.allocate() == table[2]  # then the least recently used: the prefix's tail
    assert pool.match(keys) == table[:2]  # its key is forgotten, the head still matches
    pool.share(table[0])  # a hit takes it out of the LRU
    assert pool.allocate() == table[1]
    with pytest.raises(OutOfBlocks):
        pool.allocate()


def test_a_partial_match_finds_the_cached_block_starting_with_the_most_tokens() -> None:
    """Token-granular reuse: blocks remembered with their tokens after a prefix's key are found by how many of a
    prompt's next tokens they start with (at least min_copy), and forgotten when the pool takes them back."""
    pool = BlockAllocator(4, 16)
    assert pool.min_copy == 8 and BlockAllocator(4, 4).min_copy == 2
    tail, other = pool.allocate(), pool.allocate()
    pool.remember(tail, 7, range(100, 112))  # 12 tokens after the prefix keyed 7 (a partial block)
    pool.remember(other, 7, [*range(100, 109), 5, 6])
    pool.free_table([tail, other], kept=2)  # both hold tokens: kept, other least recently used
    assert (pool.cached, pool.held) == (2, 0)
    assert pool.match_tail(7, range(100, 111)) == (tail, 11)  # the most tokens wins
    assert pool.match_tail(7, [*range(100, 109), 5]) == (other, 10)
    assert pool.match_tail(7, [100, 101, 102]) is None  # fewer than min_copy
    assert pool.match_tail(8, range(100, 112)) is None  # after another prefix
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [2, 3, other]
    assert pool.match_tail(7, [*range(100, 109), 5]) == (tail, 9)  # other's tokens went with it


def test_block_copies_travel_in_the_step_header() -> None:
    header = Header(StepKind.PREFILL, admits=((3, 4), ()), copies=((9, 12), NO_COPY))
    got = decode_changes(encode_changes(header), 2)
    assert (got.admits, got.copies) == (((3, 4), ()), ((9, 12), NO_COPY))
    alone = Header(StepKind.PREFILL, admits=((), ()), copies=(NO_COPY, (9, 12)))  # the copy alone needs a payload
    assert decode_changes(encode_changes(alone), 2).copies == alone.copies
    with pytest.raises(WireError, match="copies blocks for 2 of 3"):
        decode_changes(encode_changes(alone), 3)


def test_a_pool_holds_at_least_one_whole_context() -> None:
    assert pool_blocks(0, 100, 16, 1000, 64) == blocks_for(1001, 16)
    assert pool_blocks(10**6, 100, 16, 100, 64) == 10**6 // 1600
    assert pool_blocks(None, 100, 16, 100, 4, available=10**12) == 4 * 100 * 100 // 1600  # streams x context
    assert pool_blocks(None, 100, 16, 100, 64, available=16_000) == blocks_for(101, 16)  # a quarter: 2.5 blocks


# --- the engine on it ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_paged_gives_the_tokens_of_the_contiguous_cache(demo_dir: Path, quantize: str | None) -> None:
    """Blocks of 8 scattered over the pool (requests coming and going in between) against one block of the whole
    context per request (the old contiguous layout), with decode rows on the kernels and prefill chunks on torch."""
    requests = {"a": prompt(300), "b": prompt(70, salt=3), "c": prompt(133, salt=5), "d": prompt(9, salt=7)}
    contiguous = run(TorchEngine(demo_dir, max_seq=512, block_size=512, prefill_chunk=64, quantize=quantize), requests)
    paged = TorchEngine(demo_dir, max_seq=512, block_size=8, prefill_chunk=64, quantize=quantize)
    run(paged, {"warm": prompt(50, salt=9)})  # its blocks are cached: the next requests' tables are not in order
    assert run(paged, requests) == contiguous
    assert paged.blocks.held == 0


def test_out_of_blocks_new_requests_queue_then_are_served(demo_dir: Path) -> None:
    """A pool of 17 blocks of 16 (one 256-token context): a 200-token prompt takes 13, so a second one waits in
    the queue, visible in kv_usage, until the first leaves; then it runs and gives its cold tokens."""
    engine = TorchEngine(demo_dir, max_seq=256, block_size=16, kv_cache_bytes=0)
    assert engine.blocks.num_blocks == 17
    first, second = prompt(200), prompt(200, salt=4)
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    tokens: dict[str, list[int]] = {}
    order: list[tuple[str, str]] = []
    queued_while_first_ran = 0
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
        order += [(type(e).__name__, e.request_id) for e in engine.take_events() if not isinstance(e, Admitted)]
        if order == [("Started", "first")] and engine.kv_usage()["queued"] == 1:
            queued_while_first_ran += 1
    assert order == [("Started", "first"), ("Released", "first"), ("Started", "second"), ("Released", "second")]
    assert queued_while_first_ran >= 2  # it waited, visibly, while first decoded
    assert engine.preemptions == 0
    cold = TorchEngine(demo_dir, max_seq=256)
    assert tokens == {"first": run(cold, {"x": first})["x"], "second": run(cold, {"y": second})["y"]}


def test_a_request_that_cannot_grow_is_preempted_and_resumes_to_the_same_tokens(demo_dir: Path) -> None:
    """Four requests admitted together outgrow a pool of 13 blocks of 8 as they decode: the latest admitted are
    preempted (their generated tokens kept) and recomputed later; every request ends with its cold tokens."""
    sampling = SamplingParams(max_tokens=40, temperature=0)
    requests = {f"r{i}": prompt(30 + 3 * i, salt=i) for i in range(4)}
    engine = TorchEngine(demo_dir, max_seq=100, block_size=8, kv_cache_bytes=0)
    assert engine.blocks.num_blocks == 13
    got = run(engine, requests, sampling)
    assert engine.preemptions >= 1
    cold = {rid: run(TorchEngine(demo_dir, max_seq=100), {rid: ids}, sampling)[rid] for rid, ids in requests.items()}
    assert got == cold
    assert all(len(ids) == 40 for ids in got.values())  # nobody failed or was cut short


def test_the_same_prompt_again_reuses_every_token_but_its_last(demo_dir: Path) -> None:
    """An 89-token prompt has 25 tokens past its two whole blocks: its next run copies the cached block holding
    them (a reply that stayed inside that block, then one that filled it), and a run beside one still decoding
    copies that one's block, written up to its length; each computes its last token only and gives cold tokens."""
    ids, other = prompt(89), prompt(89, salt=3)
    short = SamplingParams(max_tokens=2, temperature=0)
    engine = TorchEngine(demo_dir, max_seq=512)
    got = run(engine, {"first": ids}, short)  # ends at 90 positions: its third block stays partial
    got |= run(engine, {"again": ids})  # copies it; its 12 tokens then fill the block
    got |= run(engine, {"third": ids})  # copies the now full block
    engine.add_request("long", other, SamplingParams(max_tokens=30, temperature=0))
    while "long" not in got:
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.token_id)
    engine.add_request("late", other, GREEDY)
    got = drain(engine, got)
    reused = {e.request_id: e.reused_tokens for e in engine.take_events() if isinstance(e, Started)}
    assert reused == {"first": 0, "again": 88, "third": 88, "long": 0, "late": 88}
    cold = TorchEngine(demo_dir, max_seq=512)
    assert got == {"first": run(cold, {"x": ids}, short)["x"], "again": run(cold, {"y": ids})["y"],
                   "third": run(cold, {"z": ids})["z"], "late": run(cold, {"u": other})["u"],
                   "long": run(cold, {"v": other}, SamplingParams(max_tokens=30, temperature=0))["v"]}


def test_an_engine_sharing_no_prefixes_copies_no_block(demo_dir: Path) -> None:
    """A mixed MLX+torch instance shares nothing (its MLX rank keeps per-request caches): no block is copied."""
    engine = TorchEngine(demo_dir, max_seq=512)
    engine.share_prefixes = False
    ids = prompt(89)
    engine.add_request("long", ids, SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    run(engine, {"beside": ids})
    run(engine, {"after": ids})
    reused = {e.request_id: e.reused_tokens for e in engine.take_events() if isinstance(e, Started)}
    assert reused == {"long": 0, "beside": 0, "after": 0}


def test_ten_chats_with_one_system_prompt_hold_it_once(demo_dir: Path) -> None:
    """Ten concurrent chats whose 2,000-token prompts share their first 1,984 tokens: the first computes them, the
    other nine share its blocks while it still runs (counted in blocks held), and give their cold tokens."""
    system = prompt(1984)
    chats = {f"chat{i}": [*system, *prompt(16, salt=i + 1)[1:], 259] for i in range(10)}
    engine = TorchEngine(demo_dir, max_seq=2100, block_size=16, prefill_chunk=2048)
    sampling = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request("chat0", chats["chat0"], sampling)
    tokens: dict[str, list[int]] = {}
    while "chat0" not in tokens:  # its prompt is in the cache, keyed
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    for rid, ids in chats.items():
        if rid != "chat0":
            engine.add_request(rid, ids, sampling)
    peak = 0
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
        peak = max(peak, engine.blocks.held)
    reused = [e.reused_tokens for e in engine.take_events() if isinstance(e, Started)]
    assert reused == [0] + [1984] * 9  # chat0 from nothing, the nine from its blocks
    one_chat = blocks_for(len(chats["chat0"]) + sampling.max_tokens, 16)  # 126 blocks
    assert peak <= one_chat + 9 * 2  # the shared 124 blocks once, and each chat's own 2 past them
    assert peak / one_chat <= 1.5
    cold = TorchEngine(demo_dir, max_seq=2100)
    assert tokens == {rid: run(cold, {rid: ids}, sampling)[rid] for rid, ids in chats.items()}


# --- the model's own context ----------------------------------------------------------------------------------

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152,
}
"""HuggingFaceTB/SmolLM2-135M-Instruct's config.json (its 8,192 positions, past the old 4,096-token cap)."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Path:
    """SmolLM2's layout and widths with random weights, 2 layers and a 512-token vocabulary (its context intact),
    with the demo model's byte tokenizer."""
    import shutil

    from tests.unit.test_model_families import write_checkpoint

    path = write_checkpoint({**SMOLLM2, "num_hidden_layers": 2, "vocab_size": 512}, tmp_path_factory.mktemp("smol"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, path / name)
    return path


def test_advertised_context_is_admitted_context(smollm2: Path) -> None:
    """The card every surface reads (/models, /v1/models, Ollama show/ps, the dashboard) says what the engine and
    the runner's admission take: a prompt of context - 1 tokens is served, one of the whole context refused."""
    import json

    from skulk.engines.errors import ContextLengthExceeded
    from skulk.models.catalog import card_from_config
    from skulk.runner.admission import context_refusal

    card = card_from_config("HuggingFaceTB/SmolLM2-135M-Instruct", json.loads((smollm2 / "config.json").read_text()),
                            1)
    engine = TorchEngine(smollm2, kv_cache_bytes=0)
    assert card.context_length == engine.context_length == 8192
    assert context_refusal(8191, SamplingParams(), engine.context_length) is None
    assert context_refusal(8192, SamplingParams(), engine.context_length) is not None
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("over", [1] * 8193, GREEDY)
    capped = TorchEngine(smollm2, max_seq=2048, kv_cache_bytes=0)  # a placement's max_context caps it
    assert capped.context_length == 2048


def test_a_6000_token_prompt_answers(smollm2: Path) -> None:
    engine = TorchEngine(smollm2, kv_cache_bytes=0)  # the smallest pool: one whole context
    long = [(7 * i) % 500 + 3 for i in range(6000)]
    got = run(engine, {"long": long}, SamplingParams(max_tokens=4, temperature=0))
    assert len(got["long"]) == 4
    assert engine.blocks.held == 0 and engine.blocks.cached == blocks_for(6003, 32)  # the last, partial, too


# --- speculative decoding -------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_ngram() -> None:
    from skulk.engines.torch.speculate import PromptLookup, accepted_prefix

    lookup = PromptLookup()
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    assert lookup.propose(tokens, 3) == [8, 9, 1]  # after the earlier 6 7
    assert lookup.propose([*tokens, 8, 9, 1, 6], 2) == [7, 8]  # the most recent occurrence of 9 1 6... is the first
    assert lookup.propose([1, 2, 3], 4) == []
    assert accepted_prefix([8, 9, 1], [8, 9, 4, 2]) == 2
    assert accepted_prefix([8], [3, 8]) == 0


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(demo_dir: Path, quantize: str | None) -> None:
    """A prompt that repeats itself (the demo model then repeats it too): prompt-lookup drafts are proposed and
    mostly accepted, and the tokens, alone and beside another stream, are exactly plain greedy decoding's."""
    repeated = prompt(200, salt=2)
    requests = {"echo": repeated, "other": prompt(60, salt=11)}
    sampling = SamplingParams(max_tokens=48, temperature=0)
    plain = run(TorchEngine(demo_dir, max_seq=512, speculate=False, quantize=quantize), requests, sampling)
    engine = TorchEngine(demo_dir, max_seq=512, quantize=quantize)
    steps = 0
    for rid, ids in requests.items():
        engine.add_request(rid, ids, sampling)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        steps += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    assert tokens == plain
    assert steps < 48  # drafts were accepted: fewer steps than tokens
    usage = engine.kv_usage()  # the totals GET /metrics reads (api/runner_metrics.py), added at each release
    assert 0 < usage["spec_accepted"] <= usage["spec_drafted"], usage


def test_speculative_decoding_reports_the_logprobs_of_plain_decoding(demo_dir: Path) -> None:
    """A request that asks for top logprobs drafts too (issue 43): its tokens are plain decoding's, each with the
    log-probability and top candidates plain decoding reports, in fewer steps than tokens."""
    repeated = prompt(200, salt=2)
    sampling = SamplingParams(max_tokens=48, temperature=0, logprobs=3)

    def reported(engine: TorchEngine) -> tuple[list[tuple[int, float, list[int]]], int]:
        engine.add_request("echo", repeated, sampling)
        got, steps = [], 0
        while engine.has_work():
            steps += 1
            for out in engine.step():
                assert out.logprobs is not None
                got.append((out.token_id, out.logprobs.logprob, [c.token for c in out.logprobs.top_logprobs]))
        return got, steps

    plain, plain_steps = reported(TorchEngine(demo_dir, max_seq=512, speculate=False))
    drafted, steps = reported(TorchEngine(demo_dir, max_seq=512))
    assert [(t, top) for t, _, top in drafted] == [(t, top) for t, _, top in plain]
    assert [lp for _, lp, _ in drafted] == pytest.approx([lp for _, lp, _ in plain], abs=1e-3)
    assert len(drafted) == 48 and steps < 48 <= plain_steps  # drafts were accepted: fewer steps than tokens


# --- sliding windows ------------------------------------------------------------------------------------------


def test_sliding_window_layers_keep_only_their_windows_blocks(tmp_path: Path, demo_dir: Path) -> None:
    """Mistral v0.1's layout (every layer slides; the window scaled to 16): blocks of 4 wholly behind the window go
    back as the request grows, so it holds about window / 4 blocks whatever its length, and its tokens are those
    of the contiguous cache (one block of the whole context, nothing freed)."""
    import shutil

    from tests.unit.test_model_families import REAL_CONFIGS, WINDOW, scaled_down, write_checkpoint

    model_id = "mistralai/Mistral-7B-v0.1"
    path = write_checkpoint(scaled_down(model_id, REAL_CONFIGS[model_id]), tmp_path / "mistral")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, path / name)
    ids = [(11 * i) % 400 + 3 for i in range(40)]
    sampling = SamplingParams(max_tokens=40, temperature=0)
    contiguous = run(TorchEngine(path, max_seq=128, block_size=128, prefill_chunk=8), {"r": ids}, sampling)
    engine = TorchEngine(path, max_seq=128, block_size=4, prefill_chunk=8)
    assert engine.window == WINDOW
    engine.add_request("r", ids, sampling)
    tokens: list[int] = []
    peak_after_prompt = 0
    while engine.has_work():
        tokens += [o.token_id for o in engine.step()]
        if tokens:
            peak_after_prompt = max(peak_after_prompt, engine.blocks.held)
    assert tokens == contiguous["r"]
    assert peak_after_prompt <= WINDOW // 4 + 2  # not the 20 blocks of its 80 positions
