"""The engine's scheduling on the demo model: chunked prefill interleaved with decode, and prefix reuse.

Counted in steps, never in time: a long prompt must not stop running streams for more than one step at a
time, and a reused prefix must give exactly the tokens a cold engine gives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from skulk.engines.base import TokenOut
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.schedule import Retained, choose_reuse, chunk_tokens, common_prefix, next_kind, spare_slot
from skulk.engines.torch.wire import Started, StepKind
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import SamplingParams

pytestmark = pytest.mark.timeout(300)

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
    outs: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work():
        for tok in engine.step():
            outs[tok.request_id].append(tok.token_id)
    return outs


def cold(demo_dir: Path, ids: list[int]) -> list[int]:
    return run(TorchEngine(demo_dir, max_seq=1024), {"cold": ids})["cold"]


def reused(engine: TorchEngine) -> dict[str, int]:
    return {e.request_id: e.reused_tokens for e in engine.take_events() if isinstance(e, Started)}


def expected_reuse(history: list[int], new: list[int]) -> int:
    """What a retained history of tokens (its last token has no KV) offers a new prompt."""
    return min(common_prefix(history[:-1], new), len(new) - 1)


def forcing(request_id: str, token: int) -> Any:
    """A fault hook that makes one request emit token forever (no EOS), leaving the others to the model."""

    def hook(where: str, req: Any) -> int | None:
        return token if where == "sample" and req.request_id == request_id else None

    return hook


# --- pure decisions -----------------------------------------------------------------------------------------


def test_prefill_rides_on_decode_while_both_are_wanted() -> None:
    both = dict(prefilling=True, can_admit=False, decoding=True)
    assert next_kind(**both) == StepKind.MIXED
    assert next_kind(prefilling=False, can_admit=True, decoding=True) == StepKind.MIXED
    assert next_kind(prefilling=False, can_admit=True, decoding=False) == StepKind.PREFILL
    assert next_kind(prefilling=False, can_admit=False, decoding=True) == StepKind.DECODE
    assert next_kind(prefilling=False, can_admit=False, decoding=False) == StepKind.HEARTBEAT


def test_chunks_are_steered_to_one_decode_step_beside_running_streams() -> None:
    assert chunk_tokens(512, decoding=False, decode_s=0.04, last_chunk=(16, 0.01)) == 512
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=None) == 16  # nothing measured yet
    assert chunk_tokens(512, decoding=True, decode_s=0.0, last_chunk=(16, 0.01)) == 16
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(16, 0.01)) == 32  # at most doubles
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(100, 0.1)) == 40  # 0.04 s at 1 ms/token
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(512, 2.0)) == 16  # never below the floor
    assert chunk_tokens(8, decoding=True, decode_s=0.04, last_chunk=(8, 0.001)) == 8  # nor above the setting
    assert chunk_tokens(512, decoding=True, decode_s=0.04, last_chunk=(64, 0.0)) == 128  # it added nothing


def test_reuse_takes_the_longest_shared_prefix_and_leaves_the_last_token() -> None:
    entries = [Retained(3, 5, 1, (1, 2, 3, 4, 5)), Retained(4, 3, 2, (1, 2, 9))]
    assert choose_reuse(entries, [1, 2, 3, 4, 5, 6]) == (3, 5)
    assert choose_reuse(entries, [1, 2, 3]) == (3, 2)  # the prompt's last token is always computed
    assert choose_reuse(entries, [7, 1, 2]) == (-1, 0)
    assert choose_reuse(entries, [1, 2, 9, 9]) == (4, 3)


def test_a_spare_slot_is_empty_or_the_least_recent() -> None:
    held = {5: Retained(5, 9, 2), 6: Retained(6, 9, 1), 7: Retained(7, 9, 3)}
    assert spare_slot(held, 4, 8, keep=set()) == 4
    assert spare_slot(held, 5, 8, keep=set()) == 6
    assert spare_slot(held, 5, 8, keep={6}) == 5
    assert spare_slot(held, 7, 8, keep={7}) is None


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


# --- prefix reuse ------------------------------------------------------------------------------------------


def test_the_next_turn_starts_from_the_previous_turns_kv(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024)
    first = prompt(400)
    reply = run(engine, {"t1": first})["t1"]
    assert reused(engine) == {"t1": 0}
    second = [*first, *reply, *b" and then?", 259]
    assert run(engine, {"t2": second})["t2"] == cold(demo_dir, second)
    assert reused(engine) == {"t2": len(first) + len(reply) - 1}  # the last reply token's KV was never computed


def test_reuse_misses_a_different_prompt_and_stops_where_prompts_diverge(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024)
    base = prompt(200)
    history = [*base, *run(engine, {"base": base})["base"]]
    other = prompt(200, salt=7)
    assert other[1] != base[1]
    assert run(engine, {"other": other})["other"] == cold(demo_dir, other)
    diverged = [*base[:120], *prompt(80, salt=9)[1:]]
    assert run(engine, {"diverged": diverged})["diverged"] == cold(demo_dir, diverged)
    # other shares only the BOS token; base's prefix survives other taking its slot
    assert reused(engine) == {"base": 0, "other": 1, "diverged": expected_reuse(history, diverged)}
    assert expected_reuse(history, diverged) >= 120


def test_two_conversations_keep_their_prefixes_while_taking_turns(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024, max_batch=4)
    a1, b1 = prompt(150), prompt(150, salt=5)
    history = [*a1, *run(engine, {"a1": a1})["a1"]]
    run(engine, {"b1": b1})  # takes slot 0: a1's prefix is parked in a spare slot, not lost
    a2 = [*a1, *b"next"]
    assert run(engine, {"a2": a2})["a2"] == cold(demo_dir, a2)
    assert reused(engine)["a2"] == expected_reuse(history, a2) >= len(a1)


def test_a_request_leaving_mid_batch_leaves_its_prefix(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=1024, max_batch=4)
    engine.fault_hook = forcing("long", 66)
    short = prompt(100, salt=2)
    engine.add_request("long", prompt(30), SamplingParams(max_tokens=40, temperature=0))
    engine.add_request("short", short, SamplingParams(max_tokens=3, temperature=0))
    history = list(short)
    while engine.has_work():  # short leaves first, from the middle of the batch: its KV is swapped out, kept
        history += [o.token_id for o in engine.step() if o.request_id == "short"]
    again = [*short, *b"!"]
    assert run(engine, {"again": again})["again"] == cold(demo_dir, again)
    assert reused(engine)["again"] == expected_reuse(history, again) >= len(short)
