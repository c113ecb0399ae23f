"""The memory arithmetic's per-stream state (memory_math.state_bytes, what placement counts an MLX rank's stream
in a linear-attention or SSM layer) against what mlx-lm really holds: a bf16 gated DeltaNet layer (Qwen3-Next)
and a bf16 Mamba 2 mixer (Nemotron-H), each stepped through a prefill and a decode step on its own cache. mlx-lm
keeps their recurrent (SSM) state in float32 whatever the weights' dtype, and the convolution's inputs in the
weights' dtype; counting the whole state in bf16 undercounted it by nearly half."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

from skulk.models.memory_math import model_memory
from tests.unit.family_checkpoints import write_model

pytestmark = pytest.mark.timeout(300)


def _first_mixer(model: Any) -> tuple[int, Any]:
    """(index, module) of the model's first linear-attention or Mamba layer."""
    inner = getattr(model, "model", None) or model.backbone
    for index, layer in enumerate(inner.layers):
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None and getattr(layer, "block_type", "") == "M":
            mixer = layer.mixer
        if mixer is not None:
            return index, mixer
    raise AssertionError("no linear-attention or Mamba layer")


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_mlx_holds_the_state_the_arithmetic_counts(tmp_path: Path, family: str) -> None:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from skulk.engines.mlx.engine import published_fields

    path = write_model(family, tmp_path)
    config = json.loads((path / "config.json").read_text())
    loaded, _ = load_model(path, model_config=published_fields(path))
    model: Any = loaded  # mlx-lm's Model: make_cache is each family's own
    model.set_dtype(mx.bfloat16)
    index, mixer = _first_mixer(model)
    cache = model.make_cache()[index]
    hidden = int(config["hidden_size"])
    x = mx.random.normal((1, 5, hidden)).astype(mx.bfloat16)
    mx.eval(mixer(x, mask=None, cache=cache))
    mx.eval(mixer(x[:, :1], mask=None, cache=cache))  # a decode step: the state it keeps between steps
    arrays = [a for a in cache.cache if a is not None]
    assert sorted(str(a.dtype) for a in arrays) == ["mlx.core.bfloat16", "mlx.core.float32"]
    held = sum(a.nbytes for a in arrays)

    memory = model_memory({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"})
    assert memory is not None
    counted = memory.layers[index].state_bytes
    assert memory.layers[index].kind in ("linear", "ssm")
    assert held == counted
