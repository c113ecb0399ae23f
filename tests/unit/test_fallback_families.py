"""The torch engine's transformers fallback (engines/torch/fallback.py) on the families people pool machines for.

For each family of family_checkpoints (DeepSeek V3, GLM-4 MoE, Mixtral, MiniMax M2, Qwen3-MoE, Qwen3-Next,
Nemotron-H, Gemma 4 in its two kinds, gpt-oss, Llama 4), two concurrent requests' 16 greedy tokens are
transformers' own (its forward over the whole sequence each step, no cache), on one rank and, for every family but
Gemma 4's per-layer-input kind (E2B/E4B, gemma4_text), as a Pipeline of three rank processes, each holding only its
stage (fallback_stage.py; the 26B-A4B kind, gemma4_moe, splits): the fallback's per-request
caches, its interleaving of requests and the native engine's sampler it reuses change nothing (DeepSeek V3 and
GLM-4 MoE run natively too, models/; the fallback still runs them, and their checks here stay). Then what a
client sees beyond greedy tokens, on one family: a cancelled request frees its cache, a stop string ends the reply,
log-probabilities are transformers', a JSON schema constrains the reply, and the runner's events come in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skulk.engines.base import Engine
from skulk.engines.torch.fallback import FallbackEngine
from skulk.engines.torch.wire import Admitted, Released, Started
from skulk.types.chat import OutputConstraint, SamplingParams
from tests.unit.family_checkpoints import (
    FAMILIES,
    MORE,
    PROMPTS,
    TOKENS,
    Reference,
    disagreement,
    reference,
    tokenizer_donor,
    write,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)
PER_LAYER_INPUTS = {"gemma4_text"}
"""Families whose layers read the token ids beside the hidden states (Gemma 4's per-layer inputs, the E2B/E4B
kind): one rank only. gemma4_moe, the cluster-sized kind, has none and is split with the rest."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fallback-families")
    demo = tokenizer_donor(root)
    return {name: write(name, root, demo) for name in (*FAMILIES, *MORE)}


def run(engine: Engine, sampling: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """Both prompts at once through any engine; every token by request, failing on any error."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, sampling)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.token_id)
    return got


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> dict[str, Reference]:
    """Per family, transformers' greedy tokens (computed once for the module)."""
    return {name: reference(path) for name, path in checkpoints.items()}


def test_every_family_gives_transformers_tokens(checkpoints: dict[str, Path],
                                                expected: dict[str, Reference]) -> None:
    wrong = {}
    for name, path in checkpoints.items():
        if (why := disagreement(run(FallbackEngine(path, max_seq=256)), expected[name])):
            wrong[name] = why
    assert not wrong, wrong


def test_every_splittable_family_gives_transformers_tokens_over_three_rank_processes(
    checkpoints: dict[str, Path], expected: dict[str, Reference], tmp_path: Path
) -> None:
    """A Pipeline of three rank processes (gloo), first layer | the middle | last layer, each building only its
    stage: both prompts' 16 tokens are transformers' for every family whose layers take only hidden states. One
    group runs the families in turn (fresh engines), so the processes start once."""
    from skulk.engines.torch.fallback_stage import layer_count
    from skulk.testing.nodes import free_port
    from tests.unit.rank_jobs import launch

    names = [n for n in checkpoints if n not in PER_LAYER_INPUTS]
    runs = [{"model": str(checkpoints[n]), "out": str(tmp_path / f"{n}.json"),
             "layers": [[0, 1], [1, layer_count(checkpoints[n]) - 1], [layer_count(checkpoints[n]) - 1,
                                                                         layer_count(checkpoints[n])]]}
            for n in names]
    port = free_port()
    launch("fallback_rank.py", [{"rank": rank, "port": port, "world_size": 3, "prompts": PROMPTS,
                                 "tokens": TOKENS, "runs": runs} for rank in range(3)], 500)
    wrong = {}
    for name, one in zip(names, runs, strict=True):
        got = json.loads(Path(one["out"]).read_text())["tokens"]
        if (why := disagreement(got, expected[name])):
            wrong[name] = why
    assert not wrong, wrong


def test_a_stage_holds_only_its_layers_and_reads_only_what_is_there(checkpoints: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """Three stages' parameters partition the whole model's (nothing held twice, the untied head on the last
    only); a stage whose tensors are missing from the files on its node is refused by name, never filled with
    random weights; a family whose layers read the ids beside the hidden states is not split."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from skulk.engines.torch.fallback_stage import StageSpan, load_stage

    path = checkpoints["mixtral"]
    spans = [StageSpan(0, 1, True, False), StageSpan(1, 2, False, False), StageSpan(2, 3, False, True)]
    stages = [dict(load_stage(path, span).named_parameters()) for span in spans]
    held = FallbackEngine(path, max_seq=256, rank=1, world_size=3, start_layer=1, end_layer=2).footprint()
    weights = sum(t.nbytes for t in stages[1].values())
    assert weights <= held[0] <= weights + 4096 and held[1] == 0, "the runner's report: its weights (and rope table)"
    whole = dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).named_parameters())
    assert sum(len(s) for s in stages) == len(whole) and set().union(*stages) == set(whole)
    assert [any(k.startswith("lm_head") for k in s) for s in stages] == [False, False, True]
    assert all(k.startswith("model.layers.1.") for k in stages[1])
    for stage in stages:
        for key, tensor in stage.items():
            assert torch.equal(tensor, whole[key]), key

    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    tensors = load_file(cut / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.q_proj.weight")
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    load_stage(cut, spans[0])  # the first stage's tensors are all there
    with pytest.raises(FileNotFoundError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        load_stage(cut, spans[1])
    with pytest.raises(ValueError, match="per-layer inputs"):
        load_stage(checkpoints["gemma4_text"], spans[0])


def test_cancel_stop_logprobs_grammar_and_events(checkpoints: dict[str, Path]) -> None:
    engine = FallbackEngine(checkpoints["mixtral"], max_seq=256)  # a family only the fallback runs
    engine.warmup()
    assert engine.take_events() == [] and not engine.has_work()
    engine.add_request("gone", PROMPTS[0], GREEDY)
    engine.add_request("kept", PROMPTS[1], GREEDY.model_copy(update={"logprobs": 2}))
    first = engine.step()  # prefills "gone" (one prompt per step)
    engine.cancel("gone")
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in first] == ["gone"] and "gone" not in {o.request_id for o in outs}
    assert set(engine._caches) == {"kept"}, "a cancelled request's cache is freed"
    kinds = [(type(e).__name__, e.request_id) for e in engine.take_events()]
    assert kinds[:4] == [("Admitted", "gone"), ("Admitted", "kept"), ("Started", "gone"), ("Released", "gone")]
    assert ("Started", "kept") in kinds
    logprob = next(o.logprobs for o in outs if o.request_id == "kept" and o.logprobs is not None)
    assert logprob is not None and len(logprob.top_logprobs) == 2 and logprob.logprob <= 0
    engine.cancel("kept")
    engine.step()
    assert [type(e).__name__ for e in engine.take_events()] == ["Released"] and not engine.has_work()

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    engine.add_request("json", PROMPTS[1], SamplingParams(max_tokens=24, temperature=0,
                                                          constraint=OutputConstraint(kind="json", json_schema=schema)))
    text = ""
    while engine.has_work():
        text += "".join(o.text for o in engine.step())
    assert isinstance(json.loads(text)["n"], int), text
    events = engine.take_events()
    assert isinstance(events[0], Admitted) and isinstance(events[1], Started) and isinstance(events[-1], Released)


def test_a_stop_string_ends_the_reply(checkpoints: dict[str, Path]) -> None:
    """The stop string is the reply's own text after a few tokens: the reply ends there, without it."""
    engine = FallbackEngine(checkpoints["qwen3_next"], max_seq=256)
    engine.add_request("a", PROMPTS[1], GREEDY)
    full = ""
    while engine.has_work():
        full += "".join(o.text for o in engine.step())
    stop = full[len(full) // 2 :][:2]
    assert stop.strip(), full
    engine.add_request("b", PROMPTS[1], GREEDY.model_copy(update={"stop": [stop]}))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_sequence == stop
    assert "".join(o.text for o in outs) == full[: full.index(stop)]


def test_requests_wait_for_the_cache_bytes_placement_reserved(checkpoints: dict[str, Path]) -> None:
    """The warmup measures what a request's cache costs (Mixtral: keys and values of 2 heads x 16 float32 values
    on 3 layers, 768 bytes a position, nothing fixed); with room reserved for one request's worst case, a second
    waits until the first leaves, the caches never hold more than the reservation, and tokens are unchanged. A
    request that could never fit is refused before it queues, saying by how much."""
    import dataclasses

    from skulk.engines.errors import PromptRejected
    from skulk.engines.torch.fallback_stage import cache_bytes

    engine = FallbackEngine(checkpoints["mixtral"], max_seq=256, kv_cache_bytes=1 << 40)
    engine.warmup()
    (cost,) = engine.costs
    assert (cost.fixed, cost.per_token, cost.windowed, cost.budget) == (0, 2 * 2 * 16 * 4 * 3, 0, 1 << 40)
    need = max(len(p) for p in PROMPTS) + TOKENS
    budget = cost.bytes_for(need) * 3 // 2
    engine.costs = [dataclasses.replace(cost, budget=budget)]
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    order = []
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].append(out.token_id)
        assert sum(cache_bytes(c, engine.span) for c in engine._caches.values()) <= budget
        order += [(type(e).__name__, e.request_id) for e in engine.take_events() if not isinstance(e, Admitted)]
    assert order == [("Started", "r0"), ("Released", "r0"), ("Started", "r1"), ("Released", "r1")]
    assert (why := disagreement(got, reference(checkpoints["mixtral"]))) is None, why
    with pytest.raises(PromptRejected, match=r"more than the \d+ bytes this instance reserved"):
        engine.add_request("big", PROMPTS[0], GREEDY.model_copy(update={"max_tokens": 200}))


def test_the_cache_cost_counts_states_as_fixed_and_sliding_layers_up_to_their_window(
    checkpoints: dict[str, Path],
) -> None:
    """Nemotron-H: its Mamba blocks' states are fixed, its one attention layer grows 2 heads x 16 float32 keys and
    values a position, its MLP block holds nothing; gpt-oss: two full layers grow without end, the two sliding
    ones (window 8) stop growing at their window."""
    costs = {}
    for name in ("nemotron_h", "gpt_oss"):
        engine = FallbackEngine(checkpoints[name], max_seq=256)
        engine.warmup()
        (costs[name],) = engine.costs
    layer = 2 * 2 * 16 * 4
    assert costs["nemotron_h"].per_token == layer and costs["nemotron_h"].fixed > 0
    assert costs["nemotron_h"].bytes_for(200) - costs["nemotron_h"].bytes_for(100) == 100 * layer
    gpt = costs["gpt_oss"]
    assert gpt.per_token == 2 * layer and gpt.budget == -1
    assert gpt.bytes_for(1000) - gpt.bytes_for(500) == 500 * 2 * layer, "the sliding layers stop at their window"
    assert gpt.bytes_for(8) >= 8 * 4 * layer, "below the window every layer holds every position"


def test_a_cache_cost_from_one_sample_counts_every_byte_as_growing() -> None:
    """A warmup that ended at its first token leaves one sample: nothing can be told fixed, so every byte is
    counted per position (over-counting, never under); two samples split a state's fixed bytes from a layer's
    growth, and holds() sums the running requests' and the newcomer's."""
    from skulk.engines.torch.fallback_stage import CacheCost

    one = CacheCost.measured(0, (10, [(1000, 0), (500, 0)]), (10, [(1000, 0), (500, 0)]), 3000)
    assert (one.fixed, one.per_token) == (0, 150) and one.bytes_for(10) == 1500
    two = CacheCost.measured(0, (10, [(1000, 0), (500, 0)]), (11, [(1100, 0), (500, 0)]), 3000)
    assert (two.fixed, two.per_token) == (500, 100) and two.bytes_for(10) == 1500
    assert two.holds([10], 10) and not two.holds([10, 5], 10)
