"""Built-in cards carry their models' real per-layer memory (issue 41: previews tell the truth, term by term).

A built-in card is what a new user places first, and without ModelMemory placement fell back to storage x
layers/n x 1.25 with no term for the runner itself, so a 1B model's preview on a small node missed by more than
half a GB. Each card's `memory` is the config arithmetic (models/memory_math.card_memory) over its published
config.json's numbers, written here so the figures can be checked and regenerated; the arithmetic must account
for the published files' bytes, as it must for a card added with POST /models/add.
"""

from __future__ import annotations

from typing import Any

import pytest

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES
from skulk.master.shard_plan import plan_ring
from skulk.models.cards import get_card
from skulk.models.demo import BUILTIN_MODELS, _llama_config
from skulk.models.memory_math import card_memory
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding

pytestmark = pytest.mark.timeout(60)


def _published(model_type: str, hidden: int, wide: int, layers: int, heads: int, kv: int, vocab: int,
               tied: bool, head_dim: int | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": model_type, "hidden_size": hidden, "intermediate_size": wide, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}
    return {**config, "head_dim": head_dim} if head_dim else config


PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B-Instruct": _published("qwen2", 896, 4864, 24, 14, 2, 151936, True),
    # Qwen3's small models tie their head in config.json but their files keep lm_head.weight beside the table:
    # a runner reading the files may hold both, so the card counts both.
    "Qwen/Qwen3-0.6B": _published("qwen3", 1024, 3072, 28, 16, 8, 151936, False, 128),
    "Qwen/Qwen3-1.7B": _published("qwen3", 2048, 6144, 28, 16, 8, 151936, False, 128),
    "meta-llama/Llama-3.2-1B-Instruct": _published("llama", 2048, 8192, 16, 32, 8, 128256, True, 64),
    "meta-llama/Llama-3.2-3B-Instruct": _published("llama", 3072, 8192, 28, 24, 8, 128256, True, 128),
    "meta-llama/Llama-3.3-70B-Instruct": _published("llama", 8192, 28672, 80, 64, 8, 128256, False, 128),
    **{model_id: _llama_config(**shape) for model_id, (shape, _) in BUILTIN_MODELS.items()},
}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_a_builtin_card_carries_its_configs_memory(model_id: str) -> None:
    card = get_card(model_id)
    assert card is not None and card.memory is not None, f"{model_id}'s card has no per-layer memory"
    expected = card_memory(PUBLISHED[model_id], card.storage_size.in_bytes)
    assert expected is not None, "the config's arithmetic no longer accounts for the files' bytes"
    assert card.memory == expected
    assert len(card.memory.layers) == card.n_layers


def test_a_builtin_llama_rank_needs_its_runtime_and_its_own_table() -> None:
    """Pipeline 2 of Llama 3.2 1B: the first rank holds the embedding, the last its own copy of the tied head,
    and each the runner's measured overhead, not storage/2 x 1.25."""
    card = get_card("meta-llama/Llama-3.2-1B-Instruct")
    assert card is not None and card.memory is not None
    plans = plan_ring(card, Sharding.Pipeline, [NodeId("a"), NodeId("b")], [20 * 2**30, 20 * 2**30])
    layers = [sum(x.weight_bytes for x in card.memory.layers[p.start_layer:p.end_layer]) for p in plans]
    assert [p.exact for p in plans] == [True, True]
    assert [p.weights_share for p in plans] == [card.memory.embed_bytes + layers[0], layers[1] + card.memory.head_bytes]
    # exact bytes count as they are (no slack), with the runtime's default ceiling until a node measured its own
    assert [p.base for p in plans] == [p.weights_share + RUNTIME_OVERHEAD_BYTES for p in plans]
    assert plans[0].base > card.storage_size.in_bytes // 2 * 1.25  # the estimate had no term for the runtime
