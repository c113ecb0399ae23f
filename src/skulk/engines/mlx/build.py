"""The runner's way into the MLX engine: one function from a RunnerSpec to a ready engine."""

from __future__ import annotations

from collections.abc import Callable

from skulk.runner.spec import RunnerSpec
from skulk.types.runners import RunnerPhase

from . import available, install_hint
from .engine import MlxEngine


class MlxUnavailable(RuntimeError):
    """Placement put an MLX rank on a node that cannot run MLX (it advertised the engine, then lost it)."""


def build_mlx_engine(spec: RunnerSpec, on_phase: Callable[[RunnerPhase, str], None]) -> MlxEngine:
    reason = available()
    if reason is not None:
        raise MlxUnavailable(f"this node cannot run the MLX engine ({reason}); install it: {install_hint()}")
    shard = spec.shard
    if shard.world_size > 1:
        raise MlxUnavailable("a multi-rank MLX instance needs the ring stage, which this build lacks")
    engine = MlxEngine(spec.model_dir, prefill_chunk=spec.prefill_chunk_tokens,
                       quantize=shard.model_card.quantize_at_load)
    del on_phase  # a single rank reports no phase changes, like the torch engine's single rank
    return engine
