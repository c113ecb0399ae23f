"""The torch engine on the demo model: correctness against transformers, batching, slicing, TP, sampling."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from skulk.engines.errors import ContextLengthExceeded
from skulk.engines.torch import matmul
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.layers import DecoderLayer
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.tokenizer import IncrementalDecoder, StopMatcher
from skulk.models.cards import all_cards, get_card, model_dir_name
from skulk.models.demo import DEMO_MODEL_ID, demo_card, ensure_demo_model
from skulk.types.chat import ChatMessage, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = [[258, 104, 105], [258, *b"hello there", 259, 10], [72, 101], [*b"abc def ghi jkl", 10, 258]]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


@pytest.fixture
def engine(demo_dir: Path) -> TorchEngine:
    return TorchEngine(demo_dir, max_batch=8, max_seq=256)


def run(engine: TorchEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[Any]]:
    """Add requests, step to completion; request id → list of its TokenOuts."""
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    outs: dict[str, list[Any]] = {rid: [] for rid in requests}
    while engine.has_work():
        for tok in engine.step():
            outs[tok.request_id].append(tok)
    return outs


def token_ids(outs: list[Any]) -> list[int]:
    return [t.token_id for t in outs]


def layer(model: ModelSlice, index: int) -> DecoderLayer:
    return cast(DecoderLayer, model.layers[str(index)])


def forward(model: ModelSlice, x: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model(x, StepBatch.build(positions, 0), cache)


# --- the model against the transformers reference -------------------------------------------------


def _tiny_hf(kind: str, path: Path) -> Path:
    common: dict[str, Any] = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    config = {
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "llama3": lambda: LlamaConfig.from_dict({**common, "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }}),
    }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # qwen2 biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["demo", "qwen2", "qwen3", "llama3"])
def test_logits_match_transformers(kind: str, demo_dir: Path, tmp_path: Path) -> None:
    path = demo_dir if kind == "demo" else _tiny_hf(kind, tmp_path / kind)
    ids = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 42, 11, 3] * 10])  # 100 tokens: past llama3's old context
    reference = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    with torch.no_grad():
        expected = reference(ids).logits
    model = load_model(path)
    got = forward(model, ids, torch.arange(ids.shape[1]).unsqueeze(0), model.make_cache(1, 128))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_override_stays_close_to_float32(demo_dir: Path) -> None:
    ids, pos = torch.tensor([[258, 104, 105, 10]]), torch.arange(4).unsqueeze(0)
    full = load_model(demo_dir)
    half = load_model(demo_dir, dtype="bfloat16")
    assert layer(half, 0).mlp.up_proj.weight.dtype == torch.bfloat16
    got = forward(half, ids, pos, half.make_cache(1, 8))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, forward(full, ids, pos, full.make_cache(1, 8)), atol=0.05, rtol=0.05)


# --- layer slices and tensor parallelism ----------------------------------------------------------


def test_chained_layer_slices_equal_whole_model(demo_dir: Path) -> None:
    whole = load_model(demo_dir)
    first, second = load_model(demo_dir, end_layer=4), load_model(demo_dir, start_layer=4)
    assert list(first.layers) == ["0", "1", "2", "3"] and first.lm_head is None
    assert list(second.layers) == ["4", "5", "6", "7"] and second.embed_tokens is None
    caches = [m.make_cache(2, 32) for m in (whole, first, second)]
    ids, pos = torch.tensor([[258, 104, 105, 10], [72, 101, 108, 108]]), torch.arange(4).repeat(2, 1)
    for _ in range(3):  # a prefill, then decode steps that read the cache each slice wrote
        expected = forward(whole, ids, pos, caches[0])
        hidden = forward(first, ids, pos, caches[1])
        assert hidden.shape == (2, ids.shape[1], 64)
        torch.testing.assert_close(forward(second, hidden, pos, caches[2]), expected, atol=1e-5, rtol=1e-5)
        ids, pos = expected[:, -1].argmax(-1, keepdim=True), pos[:, -1:] + 1


class ThreadAllReduce:
    """An in-process stand-in for a collective: each rank's thread deposits its part and gets the sum."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = torch.stack([p for p in self.parts if p is not None]).sum(0)
            self.barrier.wait()  # nobody overwrites a part before everyone has summed
            return total

        return all_reduce


def _greedy_logits(model: ModelSlice, steps: int) -> list[torch.Tensor]:
    cache = model.make_cache(1, 64)
    ids, pos, seen = torch.tensor([PROMPTS[1]]), torch.arange(len(PROMPTS[1])).unsqueeze(0), []
    for _ in range(steps):
        logits = forward(model, ids, pos, cache)[:, -1]
        seen.append(logits)
        ids, pos = logits.argmax(-1, keepdim=True), pos[:, -1:] + 1
    return seen


def test_tensor_parallel_two_ranks_equal_one(demo_dir: Path) -> None:
    reduce = ThreadAllReduce(2)
    shards = [load_model(demo_dir, tp_rank=r, tp_size=2, all_reduce=reduce.for_rank(r)) for r in range(2)]
    assert layer(shards[0], 0).self_attn.q_proj.weight.shape == (32, 64)
    assert layer(shards[1], 0).mlp.down_proj.weight.shape == (64, 64)
    assert shards[0].make_cache(1, 8).layers[0].keys.shape[1] == 1
    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(lambda m: _greedy_logits(m, 6), shards)
    expected = _greedy_logits(load_model(demo_dir), 6)
    for a, b, ref in zip(rank0, rank1, expected, strict=True):
        torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(a, b)


def test_tensor_parallel_rejects_uneven_split(demo_dir: Path) -> None:
    with pytest.raises(ValueError, match="key/value heads"):
        load_model(demo_dir, tp_rank=0, tp_size=4)


# --- the engine ---------------------------------------------------------------------------------------


def test_greedy_decoding_is_deterministic(demo_dir: Path) -> None:
    a = run(TorchEngine(demo_dir, max_seq=256), {"a": (PROMPTS[1], GREEDY)})["a"]
    b = run(TorchEngine(demo_dir, max_seq=256), {"b": (PROMPTS[1], GREEDY)})["b"]
    assert len(a) == 12 and token_ids(a) == token_ids(b)
    assert len(set(token_ids(a))) > 1


def test_batched_generation_equals_each_prompt_alone(engine: TorchEngine) -> None:
    alone = [token_ids(run(engine, {f"solo{i}": (p, GREEDY)})[f"solo{i}"]) for i, p in enumerate(PROMPTS)]
    together = run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [token_ids(together[f"r{i}"]) for i in range(4)] == alone


def test_requests_joining_and_leaving_a_running_batch(engine: TorchEngine) -> None:
    alone = [token_ids(run(engine, {f"solo{i}": (p, GREEDY)})[f"solo{i}"]) for i, p in enumerate(PROMPTS)]
    lengths = [5, 12, 3, 12]  # early finishers force slot compaction while others still decode
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for i in (0, 1):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY.model_copy(update={"max_tokens": lengths[i]}))
    for step in range(30):
        if step == 3:  # two more requests join mid-generation
            for i in (2, 3):
                engine.add_request(f"r{i}", PROMPTS[i], GREEDY.model_copy(update={"max_tokens": lengths[i]}))
        for tok in engine.step():
            outs[tok.request_id].append(tok.token_id)
    assert not engine.has_work()
    assert [outs[f"r{i}"] for i in range(4)] == [a[:n] for a, n in zip(alone, lengths, strict=True)]


def test_seed_makes_sampling_reproducible(engine: TorchEngine) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    first = token_ids(run(engine, {"a": (PROMPTS[0], seeded)})["a"])
    crowded = run(engine, {"b": (PROMPTS[0], seeded), "noise": (PROMPTS[2], SamplingParams(max_tokens=16))})
    other_seed = token_ids(run(engine, {"c": (PROMPTS[0], seeded.model_copy(update={"seed": 8}))})["c"])
    assert token_ids(crowded["b"]) == first
    assert other_seed != first


def test_top_k_one_and_tiny_top_p_are_greedy(engine: TorchEngine) -> None:
    greedy = token_ids(run(engine, {"g": (PROMPTS[3], GREEDY)})["g"])
    top_k = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3)
    top_p = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3)
    outs = run(engine, {"k": (PROMPTS[3], top_k), "p": (PROMPTS[3], top_p)})
    assert token_ids(outs["k"]) == greedy
    assert token_ids(outs["p"]) == greedy


def test_max_tokens_finishes_with_length(engine: TorchEngine) -> None:
    outs = run(engine, {"a": (PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))})["a"]
    assert [t.finish_reason for t in outs] == [None, None, None, None, "length"]


def test_stop_string_cuts_before_it_with_stop(engine: TorchEngine) -> None:
    prompt = engine.encode_chat([ChatMessage(role="user", content="hi")])
    sampling = SamplingParams(max_tokens=60, temperature=0.8, seed=1)  # seeded: varied but reproducible
    full = "".join(t.text for t in run(engine, {"a": (prompt, sampling)})["a"])
    at = next(i for i in range(10, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[at : at + 2]
    outs = run(engine, {"b": (prompt, sampling.model_copy(update={"stop": ["never-said", stop]}))})["b"]
    assert "".join(t.text for t in outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop" and len(outs) < 60
    assert all(t.finish_reason is None for t in outs[:-1])


def test_eos_finishes_with_stop_and_no_text(engine: TorchEngine) -> None:
    first = token_ids(run(engine, {"a": (PROMPTS[1], GREEDY)})["a"])[0]
    engine.tokenizer.eos_ids = frozenset({first})
    outs = run(engine, {"b": (PROMPTS[1], GREEDY)})["b"]
    assert [(t.token_id, t.text, t.finish_reason) for t in outs] == [(first, "", "stop")]


def test_cancel_frees_the_slot(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_batch=2, max_seq=256)
    long = SamplingParams(max_tokens=50, temperature=0)
    solo_b = token_ids(run(engine, {"solo_b": (PROMPTS[1], long)})["solo_b"])
    solo_c = token_ids(run(engine, {"solo_c": (PROMPTS[2], GREEDY)})["solo_c"])
    engine.add_request("a", PROMPTS[0], long)
    engine.add_request("b", PROMPTS[1], long)
    engine.add_request("c", PROMPTS[2], GREEDY)
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for tok in engine.step() + engine.step():
        seen[tok.request_id].append(tok.token_id)
    assert seen["c"] == []  # both slots busy: c waits
    before_cancel = len(seen["a"])
    assert before_cancel >= 1
    engine.cancel("a")
    while engine.has_work():
        for tok in engine.step():
            seen[tok.request_id].append(tok.token_id)
    assert len(seen["a"]) == before_cancel  # nothing after the cancel
    assert seen["c"] == solo_c  # c took a's slot; stale cache entries never leak in
    assert seen["b"] == solo_b  # b was moved to slot 0 mid-generation
    assert not engine.has_work()


def test_prompt_over_context_is_rejected(demo_dir: Path) -> None:
    engine = TorchEngine(demo_dir, max_seq=32)
    assert engine.context_length == 32
    with pytest.raises(ContextLengthExceeded, match=r"33 tokens.*32 tokens") as raised:
        engine.add_request("a", [65] * 33, GREEDY)
    assert isinstance(raised.value, ValueError) and not engine.has_work()
    outs = run(engine, {"b": ([65] * 30, SamplingParams(max_tokens=100, temperature=0))})["b"]
    assert len(outs) == 2 and outs[-1].finish_reason == "length"  # prompt plus completion fill the 32 positions


def test_warmup_leaves_no_work(engine: TorchEngine) -> None:
    engine.warmup()
    assert not engine.has_work()


def test_encode_chat_uses_the_template(engine: TorchEngine) -> None:
    ids = engine.encode_chat([ChatMessage(role="user", content="hé 🦊")])
    assert ids == [258, *b"user\n", *"hé 🦊".encode(), 259, 10, 258, *b"assistant\n"]


# --- streaming text -------------------------------------------------------------------------------


def test_incremental_decoder_never_splits_a_codepoint(engine: TorchEngine) -> None:
    text = "a🦊é中b"
    decoder = IncrementalDecoder(engine.tokenizer.decode)
    deltas = [decoder.push(b) for b in text.encode()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + decoder.flush() == text
    assert deltas[1:5] == ["", "", "", "🦊"]


def test_stop_matcher_holds_back_a_split_stop_string() -> None:
    matcher = StopMatcher(["END", "xyz"])
    assert matcher.push("hello E") == ("hello ", False)
    assert matcher.push("N") == ("", False)
    assert matcher.push("Dless") == ("", True) and matcher.matched == "END"
    matcher = StopMatcher(["b", "a"])  # the earliest in the text ends it, whatever the list's order
    assert matcher.push("xxaxb") == ("xx", True) and matcher.matched == "a"
    matcher = StopMatcher(["END"])
    assert matcher.push("EN") == ("", False)
    assert matcher.push("tity") == ("ENtity", False)
    assert matcher.flush() == "" and matcher.matched is None


# --- cards ----------------------------------------------------------------------------------------


def test_cards_load_with_positive_numbers() -> None:
    cards = all_cards()
    assert len(cards) >= 7
    for card in cards:
        numbers = [card.n_layers, card.hidden_size, card.num_attention_heads, card.num_key_value_heads]
        assert all(n > 0 for n in numbers), card.model_id
        assert card.storage_size.in_bytes > 0 and card.context_length > 0
        assert card.num_attention_heads % card.num_key_value_heads == 0
    qwen = get_card("Qwen/Qwen3-0.6B")
    assert qwen is not None and (qwen.n_layers, qwen.hidden_size, qwen.num_key_value_heads) == (28, 1024, 8)
    quantized = get_card("mlx-community/Llama-3.2-1B-Instruct-4bit")
    assert quantized is not None and quantized.quantization == "4bit"
    assert get_card(DEMO_MODEL_ID) == demo_card() and get_card("nobody/nothing") is None
    assert model_dir_name("Qwen/Qwen3-0.6B") == "Qwen--Qwen3-0.6B"


@pytest.mark.parametrize(("dtype", "native_bf16"), [(torch.float16, False), (torch.bfloat16, False),
                                                     (torch.bfloat16, True)])
def test_half_linear_many_rows_is_an_f32_gemm_cast_in_blocks(dtype: torch.dtype, native_bf16: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-sized matmul on a half weight larger than one cast block (3 blocks and a rest), with a bias:
    the f32 GEMM's result rounded once, whatever the blocking; and where the CPU has a bf16 GEMM, bf16 takes
    torch's, within the same one rounding step."""
    if native_bf16 and not matmul.native_bf16_gemm():
        pytest.skip("this CPU has no bf16 GEMM (AVX-512 BF16 or AMX)")
    monkeypatch.setattr(matmul, "native_bf16_gemm", lambda: native_bf16)
    torch.manual_seed(0)
    out_features, in_features = 2 * matmul.CAST_ELEMENTS // 1000 + 7, 1000
    linear = matmul.Linear(in_features, out_features, bias=True).to(dtype)
    x = torch.randn(2, 10, in_features).to(dtype)
    assert matmul.wants_float_gemm(x, linear.weight) == (dtype == torch.float16 or not native_bf16)
    with torch.inference_mode():
        got = linear(x)
    expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).to(dtype)
    assert got.shape == (2, 10, out_features) and got.dtype == dtype
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # one rounding step apart at most, element by element
    assert bool(((got.float() - expected.float()).abs() <= expected.float().abs() * ulp + 1e-6).all())
