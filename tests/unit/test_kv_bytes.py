"""Placement's KV arithmetic against the engine's own cache: the pool placement reserves for a rank is the pool
that rank's engine builds (issue 32). Scaled-down real configs (test_model_families), random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from skulk.engines.torch.loader import load_model
from skulk.master.shard_plan import kv_bytes_per_token
from skulk.models.catalog import card_from_config

from .test_model_families import REAL_CONFIGS, scaled_down, write_checkpoint
from .test_paged_cache import SMOLLM2

pytestmark = pytest.mark.timeout(180)

CONFIGS: dict[str, dict[str, Any]] = {**REAL_CONFIGS, "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2}


def _no_reduce(tensor: Any) -> Any:
    return tensor


@pytest.mark.parametrize("model_id", sorted(CONFIGS))
def test_placements_kv_bytes_per_token_are_the_engines(model_id: str, tmp_path: Path) -> None:
    real = CONFIGS[model_id]
    config = scaled_down(model_id, real, layers=3) if model_id in REAL_CONFIGS else {
        **real, "num_hidden_layers": 3, "vocab_size": 512}
    path = write_checkpoint(config, tmp_path / "model")
    card = card_from_config(model_id, config, 1)
    layers = card.n_layers  # 3, or Gemma 3's whole local/global period
    whole = load_model(path)
    assert kv_bytes_per_token(card, layers) == whole.kv_bytes_per_token()
    stage = load_model(path, start_layer=1, end_layer=layers)  # a Pipeline rank: only its layers
    assert kv_bytes_per_token(card, layers - 1) == stage.kv_bytes_per_token()
    if card.num_key_value_heads % 2 == 0 and card.num_attention_heads % 2 == 0:
        half = load_model(path, tp_rank=1, tp_size=2, all_reduce=_no_reduce)  # a Tensor rank: its heads
        assert kv_bytes_per_token(card, layers, tensor_ways=2) == half.kv_bytes_per_token()
