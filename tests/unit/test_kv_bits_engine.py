"""The torch engine on a quantized KV cache (issue 41): its pools are the quantized ones, a shared prefix and its
copied block work on them, and on SmolLM2 (when the default model's file is on this machine) greedy text at 8 bits
is 16 bits' text. The quality cost in numbers is bench/quality.py's KV rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skulk.engines.torch.cache import QuantizedLayerCache, StepBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatMessage, SamplingParams
from tests.unit.test_paged_cache import drain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PREFIX = [258, *(b"Quantized keys and values hold more context in the same memory. " * 3)]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("bits", [8, 4])
def test_an_engine_at_fewer_bits_serves_from_quantized_pools(demo_dir: Path, bits: int) -> None:
    """Two requests sharing a prefix (its full blocks shared, the partial one copied: copy_block on the packed
    pools) each get their tokens, from a pool whose blocks cost the quantized bytes."""
    full = TorchEngine(demo_dir, max_batch=4, speculate=False, max_seq=256, kv_cache_bytes=1 << 20)
    engine = TorchEngine(demo_dir, max_batch=4, speculate=False, max_seq=256, kv_cache_bytes=1 << 20,
                         kv_cache_bits=bits)
    try:
        assert all(isinstance(layer, QuantizedLayerCache) for layer in engine.cache.layers)
        assert engine.blocks.num_blocks > full.blocks.num_blocks  # the same bytes hold more positions
        engine.add_request("a", PREFIX, GREEDY)
        first = drain(engine)
        engine.add_request("b", [*PREFIX, 7, 9], GREEDY)
        engine.add_request("c", PREFIX, GREEDY)
        later = drain(engine)
        assert len(first["a"]) == len(later["b"]) == GREEDY.max_tokens
        assert later["c"] == first["a"]  # the cached prefix, read back from the packed pool, decodes the same
    finally:
        engine.close()
        full.close()


def test_logits_through_an_8_bit_cache_stay_close_to_16_bits(demo_dir: Path) -> None:
    model = load_model(demo_dir)
    ids = torch.tensor([PREFIX])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        logps = {bits: torch.log_softmax(model(ids, StepBatch.build(positions, 0),
                                               model.make_cache(1, ids.shape[1], bits=bits))[0].float(), -1)
                 for bits in (16, 8, 4)}
    kl = {bits: float((logps[16].exp() * (logps[16] - logps[bits])).sum(-1).mean()) for bits in (8, 4)}
    assert 0 < kl[8] < kl[4] < 0.05, kl


def test_smollm2_says_the_same_at_8_bits(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A question whose answer has no near tie at 16 bits: SmolLM2's bf16 logits tie exactly on "What is the
    capital of France?" ('L' and 'The' both -1.889), which any change of rounding, 8-bit KV's included, flips;
    that is the float32-logits part of issue 41, not this one's."""
    from skulk.models.packaged import SMOLLM2, shared_cache
    from tests.unit.smollm2 import packaged_smollm2

    gguf = shared_cache() / f"{SMOLLM2.package}-{SMOLLM2.version}" / Path(SMOLLM2.member).name
    if not gguf.is_file():
        pytest.skip(f"the default model's file is not on this machine ({gguf}; `make run` fetches it)")
    model_dir = packaged_smollm2(tmp_path_factory)
    texts = {}
    for bits in (16, 8):
        engine = TorchEngine(model_dir, max_batch=2, speculate=False, kv_cache_bytes=64 << 20, kv_cache_bits=bits)
        try:
            prompt = engine.encode_chat([ChatMessage(role="user", content="Why is the sky blue?")])
            engine.add_request("q", prompt, SamplingParams(max_tokens=12, temperature=0))
            texts[bits] = drain(engine)["q"]
        finally:
            engine.close()
    assert texts[8] == texts[16]
