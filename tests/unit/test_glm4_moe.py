"""GLM-4 MoE on the torch engine's own layers (engines/torch/models/glm4_moe.py), against transformers' modeling.

Two seeded random checkpoints in transformers 5's layout: family_checkpoints' (the one the fallback and MLX tests
share: partial rotary, a dense first layer then experts with a shared one), and a variant that turns on what
that one leaves off (q/k norm, q/k/v bias, two expert groups of which one is eligible, a spread correction bias,
unnormalised weights scaled by 2.5, two shared experts, a quarter of each head rotated). Each one's 16 greedy
tokens for two prompts are transformers' (its forward over the whole sequence each step): on one rank through
the engine (both prompts batched), and through a two-stage pipeline; two tensor-parallel ranks give one rank's
logits; bfloat16 stays near transformers' bfloat16. The catalog then cards the family as native."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from skulk.engines.torch.cache import MixedBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.layers import DecoderLayer
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models import read_args_dir
from skulk.engines.torch.moe import GroupedMoe, grouped_top_k
from skulk.models.catalog import card_from_config
from skulk.models.memory_math import model_memory
from skulk.types.chat import SamplingParams
from tests.unit.family_checkpoints import (
    COMMON,
    FAMILIES,
    PROMPTS,
    TOKENS,
    disagreement,
    reference,
    save_drawn,
    tokenizer_donor,
    write,
)
from tests.unit.test_fallback_families import run
from tests.unit.test_new_families import greedy_stages
from tests.unit.test_quantized import logits
from tests.unit.test_torch_engine import ThreadAllReduce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real model compute: `make test`, not `make test-fast`

GROUPED: dict[str, Any] = {
    "use_qk_norm": True, "attention_bias": True, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3,
    "routed_scaling_factor": 2.5, "norm_topk_prob": False, "n_shared_experts": 2, "partial_rotary_factor": 0.25,
}
"""What the shared checkpoint leaves off (its config is transformers' defaults there)."""
IDS = torch.tensor([PROMPTS[0]])


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: a second torch thread only adds barrier waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write_grouped(root: Path, demo: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The variant: its biases, q/k norm weights and router correction bias drawn (transformers starts them at
    zero or one, which would test nothing)."""
    import transformers

    torch.manual_seed(1)
    config = transformers.Glm4MoeConfig(**(COMMON | FAMILIES["glm4_moe"][2] | GROUPED))
    model = transformers.Glm4MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("proj.bias", "e_score_correction_bias")):
                tensor.normal_(0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.normal_(1, 0.2)
    return save_drawn(model, root, "glm4_moe_grouped", dtype, demo)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4-moe")
    demo = tokenizer_donor(root)
    return {"shared": write("glm4_moe", root, demo), "grouped": _write_grouped(root, demo),
            "grouped_bf16": _write_grouped(root, demo, torch.bfloat16)}


def _engine_tokens(path: Path) -> dict[str, list[int]]:
    """Both prompts at once through the engine (prefill, then batched decode steps)."""
    return run(TorchEngine(path, max_batch=2, max_seq=64))


def _staged_tokens(stages: list[ModelSlice], prompt: list[int]) -> list[int]:
    """Greedy tokens through a chain of pipeline stages: the prompt in one pass, then one token per step."""
    return greedy_stages(stages, TOKENS, torch.tensor([prompt]))


def assert_transformers_tokens(path: Path) -> None:
    """16 greedy tokens of both prompts equal transformers' through the engine on one rank, through two pipeline
    stages (dense + MoE | MoE), and through three: the first layer, the middle ones, the last (each stage builds
    only its own layers, a middle one neither the embedding nor the head). DeepSeek V3, gpt-oss, Qwen3-Next and
    Qwen3.5 hold their families to the same."""
    expected = reference(path)
    assert (why := disagreement(_engine_tokens(path), expected)) is None, f"one rank: {why}"
    layers = read_args_dir(path).num_hidden_layers
    for cuts in ([2], [1, layers - 1]):
        bounds = [0, *cuts, layers]
        stages = [load_model(path, start_layer=a, end_layer=b) for a, b in itertools.pairwise(bounds)]
        piped = {f"r{i}": _staged_tokens(stages, prompt) for i, prompt in enumerate(PROMPTS)}
        assert (why := disagreement(piped, expected)) is None, f"pipeline over {bounds}: {why}"


def assert_tensor_ranks_match(path: Path) -> None:
    """Two tensor-parallel ranks give one rank's logits."""
    whole = logits(load_model(path), IDS)
    reduce = ThreadAllReduce(2)
    shards = [load_model(path, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(lambda m: logits(m, IDS), shards))
    for rank in ranks:
        torch.testing.assert_close(rank, whole, atol=1e-4, rtol=1e-4)


def assert_bf16_near_transformers(path: Path) -> None:
    """A bfloat16 checkpoint in bfloat16 on both sides: each position's logits within 3% of transformers', but
    for at most one position per prompt (an expert-group tie, as test_bfloat16_stays_near_transformers says)."""
    from transformers import AutoModelForCausalLM

    model = load_model(path)
    assert next(model.parameters()).dtype == torch.bfloat16
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = theirs(ids).logits.float()[0]
        got = logits(model, ids)[0]
        errors = (got - expected).abs().amax(-1) / expected.abs().amax(-1)
        assert int((errors >= 0.03).sum()) <= 1, errors


def held_bytes(module: nn.Module) -> int:
    """The bytes `module`'s parameters and buffers hold, each storage once (a view shares its base's)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}.values())


def assert_mixed_step_tokens(path: Path, attention: type[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """A second request arriving while the first decodes: its prefill shares steps with the decode row (a
    MixedBatch, each part attended on its own rows by the family's `attention`), and both still give
    transformers' tokens."""
    mixed, forward = [], attention.forward

    def counting(self: nn.Module, x: torch.Tensor, batch: Any, rope: Any, cache: Any) -> torch.Tensor:
        mixed.append(isinstance(batch, MixedBatch))
        return forward(self, x, batch, rope, cache)

    monkeypatch.setattr(attention, "forward", counting)
    engine = TorchEngine(path, max_batch=2, max_seq=64)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0)
    engine.add_request("r0", PROMPTS[0], greedy)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    for step in range(4 * TOKENS):
        if step == 3:
            engine.add_request("r1", PROMPTS[1], greedy)
        if step > 3 and not engine.has_work():
            break
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.token_id)
    assert any(mixed), "no step mixed the prefill with the decode"
    assert (why := disagreement(got, reference(path))) is None, why


@pytest.mark.parametrize("name", ["shared", "grouped"])
def test_greedy_tokens_are_transformers_on_one_rank_and_a_pipeline(name: str, checkpoints: dict[str, Path]) -> None:
    assert_transformers_tokens(checkpoints[name])


def test_the_layers_are_the_configs(checkpoints: dict[str, Path]) -> None:
    """Layer 0 dense, the rest grouped MoE with shared experts; a quarter of each 16-wide head rotated; the
    correction bias kept float32 in a bfloat16 model (rounding it would change which experts run)."""
    model = load_model(checkpoints["grouped"], dtype=torch.bfloat16)
    assert model.args.rotary_dim == 4 and model.args.qk_norm and model.args.attention_bias
    dense = model.layers["0"]
    assert isinstance(dense, DecoderLayer) and not isinstance(dense.mlp, GroupedMoe)
    moe = model.layers["1"].mlp
    assert isinstance(moe, GroupedMoe) and moe.shared_experts is not None
    assert moe.shared_experts.down_proj.weight.shape == (64, 64)  # 2 shared experts x 32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32 and moe.gate.weight.dtype == torch.bfloat16
    assert dense.native(torch.bfloat16, model.make_cache(1, 16).layers[0]) is None  # partial rotary


def test_grouped_top_k_picks_only_from_the_best_groups() -> None:
    """Group scores are each group's two best biased scores summed; the bias chooses, the raw score weighs."""
    scores = torch.tensor([[0.9, 0.1, 0.1, 0.1, 0.6, 0.5, 0.4, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    weights, chosen = grouped_top_k(scores, bias, 2, 2, 1, normalize=False, scale=2.0)
    assert sorted(chosen[0].tolist()) == [4, 7]  # group 1 (1.1 + 0.6) beats group 0 (0.9 + 0.1); 7 by its bias
    assert sorted(weights[0].tolist()) == pytest.approx([0.2, 1.2])  # the raw scores, times 2
    weights, _ = grouped_top_k(scores, bias, 2, 2, 1, normalize=True, scale=1.0)
    assert float(weights.sum()) == pytest.approx(1.0)


def test_tensor_parallel_ranks_give_one_ranks_logits(checkpoints: dict[str, Path]) -> None:
    assert_tensor_ranks_match(checkpoints["grouped"])


def test_bfloat16_stays_near_transformers(checkpoints: dict[str, Path]) -> None:
    """A bfloat16 checkpoint in bfloat16 on both sides: only rounding order differs (float32 matches above), each
    position's logits within 3% of transformers'. Not every position: a token whose two expert groups score
    within rounding of each other (seen: 1.3503 against 1.3499) may take the other group in either dtype, a
    legitimate flip that moves its logits wholesale; one such position per prompt is allowed."""
    assert_bf16_near_transformers(checkpoints["grouped_bf16"])


def test_the_catalog_cards_glm4_moe_as_native(checkpoints: dict[str, Path]) -> None:
    """Native now: its card says so (placement may split it over torch ranks), and the per-layer memory
    arithmetic (models/memory_math.model_memory) is the bytes the engine holds, layer for layer (each storage
    once: fuse_projections' stacked q/k/v and gate/up are the parts' own rows)."""
    import json

    path = checkpoints["grouped"]
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("zai-org/glm-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "glm4_moe"
    memory = model_memory(config)
    assert memory is not None
    model = load_model(path)
    held = [held_bytes(layer) for layer in model.layers.values()]
    assert [layer.weight_bytes for layer in memory.layers] == held
