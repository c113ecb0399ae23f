"""The engine's scheduling on the demo model: chunked prefill interleaved with decode, and prefix reuse through the
paged cache's shared blocks.

Counted in steps, never in time: a long prompt must not stop running streams for more than one step at a
time, and a reused prefix must give exactly the tokens a cold engine gives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from skulk.engines.base import TokenOut
from skulk.engines.torch import schedule
from skulk.engines.torch.blocks import MIN_COPY, common_prefix
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.schedule import (
    CHUNK_STEPS,
    MIN_CHUNK,
    can_admit,
    chunk_tokens,
    next_kind,
    share_chunk,
)
from skulk.engines.torch.wire import MAX_ADMITS, Started, StepKind
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # runs real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=8, temperature=0)
TEXT = [*b"The quick brown fox jumps over the lazy dog, and then it runs away into the woods. "] * 8


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [258, *((w + salt) % 250 + 1 for w in TEXT)][:n]


def run(engine: TorchEngine, requests: dict[str, list[int]], sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for rid, ids in requests.items():
        engine.add_request(rid, ids, sampling)
    return drain(engine, {rid: [] for rid in requests})


def drain(engine: TorchEngine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """Step until the engine is idle, adding every token to tokens."""
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return tokens


def cold(demo_dir: Path, ids: list[int]) -> list[int]:
    return run(TorchEngine(demo_dir, max_seq=1024), {"cold": ids})["cold"]


def reused(engine: TorchEngine) -> dict[str, int]:
    return {e.request_id: e.reused_tokens for e in engine.take_events() if isinstance(e, Started)}


def expected_reuse(history: list[int], new: list[int], block: int = 32) -> int:
    """What a cached history of tokens (its last token has no KV) offers a new prompt, token-granular: its full
    shared blocks, then the tokens of the next block it starts with when there are at least MIN_COPY of them (that
    block is copied). The prompt's last token is always computed."""
    same = min(common_prefix(history[:-1], new), len(new) - 1)
    return same if same % block >= MIN_COPY else same // block * block


def forcing(request_id: str, token: int) -> Any:
    """A fault hook that makes one request emit token forever (no EOS), leaving the others to the model."""

    def hook(where: str, req: Any) -> int | None:
        return token if where == "sample" and req.request_id == request_id else None

    return hook


# --- pure decisions -----------------------------------------------------------------------------------------


def test_prefill_rides_on_decode_while_both_are_wanted() -> None:
    assert next_kind(prefilling=True, decoding=True) == StepKind.MIXED
    assert next_kind(prefilling=True, decoding=False) == StepKind.PREFILL
    assert next_kind(prefilling=False, decoding=True) == StepKind.DECODE
    assert next_kind(prefilling=False, decoding=False) == StepKind.HEARTBEAT


def test_a_chunk_is_shared_in_slot_order_and_admits_while_it_lasts() -> None:
    assert share_chunk([30, 40, 500], 100) == [30, 40, 30]  # the first prompts finish, the last gets the rest
    assert share_chunk([300, 5], 64) == [64, 0]  # a long prompt ahead is never starved by a later short one
    assert share_chunk([3], 0) == [1]  # a prefill step always progresses
    assert can_admit(rests=[30, 40], chunk=100, free_slots=1, admitted=1)
    assert not can_admit(rests=[60, 40], chunk=100, free_slots=1, admitted=1)  # nothing left for a newcomer
    assert not can_admit(rests=[], chunk=100, free_slots=0, admitted=0)
    assert not can_admit(rests=[], chunk=100, free_slots=4, admitted=MAX_ADMITS)
    assert can_admit(rests=[], chunk=0, free_slots=1, admitted=0)


def test_chunks_are_steered_to_most_of_a_decode_step_beside_running_streams() -> None:
    assert (MIN_CHUNK, CHUNK_STEPS) == (4, 0.8)
    assert chunk_tokens(512, decoding=False, decode_s=0.04, last_chunk=(16, 0.01)) == 512
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=None) == 4  # nothing measured yet
    assert chunk_tokens(512, decoding=True, decode_s=0.0, last_chunk=(16, 0.01)) == 4
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(16, 0.01)) == 32  # at most doubles
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(100, 0.1)) == 32  # 0.032 s at 1 ms/token
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(512, 8.0)) == 4  # never below the floor
    assert chunk_tokens(2, decoding=True, decode_s=0.04, last_chunk=(2, 0.001)) == 2  # nor above the setting
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(64, 0.0)) == 128  # it added nothing


# --- chunked prefill ---------------------------------------------------------------------------------------


def test_a_chunked_prefill_gives_the_tokens_of_a_whole_one(demo_dir: Path) -> None:
    ids = prompt(300)
    engine = TorchEngine(demo_dir, max_seq=1024, prefill_chunk=16)
    engine.add_request("r", ids, GREEDY)
    steps = 0
    first: list[TokenOut] = []
    while not first:
        first = engine.step()
        steps += 1
    assert steps == math.ceil(len(ids) / 16)  # alone, every step is one full chunk
    rest = [t.token_id for t in first]
    while engine.has_work():
        rest += [t.token_id for t in engine.step()]
    assert rest == cold(demo_dir, ids)


def test_running_streams_get_a_token_every_step_during_a_long_prefill(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024, prefill_chunk=32)
    engine.fault_hook = forcing("a", 65)
    engine.add_request("a", prompt(20), SamplingParams(max_tokens=500, temperature=0))
    while not engine.step():
        pass
    long = prompt(700, salt=3)
    engine.add_request("long", long, GREEDY)
    since_a: list[int] = []  # steps between a's tokens while long is prefilled
    gap, steps = 0, 0
    long_tokens: list[int] = []
    while not long_tokens:
        outs = engine.step()
        steps += 1
        gap += 1
        if any(o.request_id == "a" for o in outs):
            since_a.append(gap)
            gap = 0
        long_tokens = [o.token_id for o in outs if o.request_id == "long"]
    assert steps >= math.ceil(len(long) / 32)  # the prompt went in chunks, not one step
    assert since_a == [1] * steps  # every chunk rode on a decode step: a never waited for one
    while engine.has_work() and len(long_tokens) < GREEDY.max_tokens:
        long_tokens += [o.token_id for o in engine.step() if o.request_id == "long"]
    engine.cancel("a")
    assert long_tokens == cold(demo_dir, long)


def first_tokens(engine: TorchEngine, ids: list[str]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Step until every request in ids has its first token: the step at which each got it, and every token so
    far by request."""
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while not set(ids) <= set(first):
        steps += 1
        for out in engine.step():
            first.setdefault(out.request_id, steps)
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return first, tokens


def test_a_burst_of_short_prompts_is_admitted_in_one_step(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024)
    burst = {f"r{i}": prompt(40 + 7 * i, salt=i) for i in range(5)}
    for rid, ids in burst.items():
        engine.add_request(rid, ids, GREEDY)
    first, tokens = first_tokens(engine, list(burst))
    assert first == dict.fromkeys(burst, 1)  # one prefill step, not one per prompt
    assert drain(engine, tokens) == {rid: cold(demo_dir, ids) for rid, ids in burst.items()}


@pytest.mark.parametrize(("floor", "length"), [(16, 5), (64, 21)])
def test_short_prompts_beside_a_stream_join_it_in_one_step(
    demo_dir: Path, floor: int, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 + 3 x 5 rows take the one-call layer stack, 1 + 3 x 21 the per-layer path."""
    monkeypatch.setattr(schedule, "MIN_CHUNK", floor)  # the first riding chunk, before any is measured
    engine = TorchEngine(demo_dir, max_seq=1024)
    engine.fault_hook = forcing("a", 65)
    engine.add_request("a", prompt(20), SamplingParams(max_tokens=60, temperature=0))
    while not engine.step():
        pass
    burst = {f"s{i}": prompt(length, salt=i + 1) for i in range(3)}  # 3 x length tokens fit the floor chunk
    for rid, ids in burst.items():
        engine.add_request(rid, ids, GREEDY)
    first, tokens = first_tokens(engine, [*burst, "a"])
    assert set(first.values()) == {1}  # all three rode on a's next decode step
    tokens = drain(engine, tokens)
    assert {rid: tokens[rid] for rid in burst} == {rid: cold(demo_dir, ids) for rid, ids in burst.items()}


# --- prefix reuse ------------------------------------------------------------------------------------------


def test_the_next_turn_starts_from_the_previous_turns_kv(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024)
    first = prompt(400)
    reply = run(engine, {"t1": first})["t1"]
    assert reused(engine) == {"t1": 0}
    second = [*first, *reply, *b" and then?", 259]
    assert run(engine, {"t2": second})["t2"] == cold(demo_dir, second)
    # every token before the last reply token (whose KV was never computed): 12 whole blocks, 23 tokens copied
    assert reused(engine) == {"t2": len(first) + len(reply) - 1} == {"t2": 407}


def test_reuse_misses_a_different_prompt_and_stops_where_prompts_diverge(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024)
    base = prompt(200)
    history = [*base, *run(engine, {"base": base})["base"]]
    other = prompt(200, salt=7)
    assert other[1] != base[1]
    assert run(engine, {"other": other})["other"] == cold(demo_dir, other)
    diverged = [*base[:120], *prompt(80, salt=9)[1:]]
    assert run(engine, {"diverged": diverged})["diverged"] == cold(demo_dir, diverged)
    # other shares only the BOS token, fewer than MIN_COPY; base's blocks survive other's run
    assert reused(engine) == {"base": 0, "other": 0, "diverged": expected_reuse(history, diverged)}
    assert expected_reuse(history, diverged) == 120  # 3 whole blocks, then 24 tokens of the 4th copied


def test_two_conversations_keep_their_prefixes_while_taking_turns(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024, max_batch=4)
    a1, b1 = prompt(150), prompt(150, salt=5)
    history = [*a1, *run(engine, {"a1": a1})["a1"]]
    run(engine, {"b1": b1})  # its blocks come from the free ones: a1's cached blocks are not evicted
    a2 = [*a1, *b"next"]
    assert run(engine, {"a2": a2})["a2"] == cold(demo_dir, a2)
    assert reused(engine)["a2"] == expected_reuse(history, a2) == len(a1)


def test_two_next_turns_admitted_together_each_reuse_their_own_prefix(demo_dir: Path) -> None:
    """One step admits both, each onto its own cached blocks."""
    engine = TorchEngine(demo_dir, max_seq=1024, max_batch=4)
    a1, b1 = prompt(150), prompt(150, salt=5)
    histories = {k: [*v, *run(engine, {k: v})[k]] for k, v in (("a1", a1), ("b1", b1))}
    reused(engine)  # the first turns' events
    turns = {"a2": [*a1, *b"next"], "b2": [*b1, *b"again"]}
    for rid, ids in turns.items():
        engine.add_request(rid, ids, GREEDY)
    first, tokens = first_tokens(engine, list(turns))
    assert first == {"a2": 1, "b2": 1}
    got = reused(engine)
    assert got == {"a2": expected_reuse(histories["a1"], turns["a2"]),
                   "b2": expected_reuse(histories["b1"], turns["b2"])}
    assert min(got.values()) == 150  # every token of the first turn: 4 whole blocks and 22 copied
    assert drain(engine, tokens) == {rid: cold(demo_dir, ids) for rid, ids in turns.items()}


def test_a_request_leaving_mid_batch_leaves_its_prefix(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024, max_batch=4)
    engine.fault_hook = forcing("long", 66)
    short = prompt(100, salt=2)
    engine.add_request("long", prompt(30), SamplingParams(max_tokens=40, temperature=0))
    engine.add_request("short", short, SamplingParams(max_tokens=3, temperature=0))
    history = list(short)
    while engine.has_work():  # short leaves first, from the middle of the batch: its full blocks stay cached
        history += [o.token_id for o in engine.step() if o.request_id == "short"]
    again = [*short, *b"!"]
    assert run(engine, {"again": again})["again"] == cold(demo_dir, again)
    assert reused(engine)["again"] == expected_reuse(history, again) == len(short) // 32 * 32  # 4 < MIN_COPY
