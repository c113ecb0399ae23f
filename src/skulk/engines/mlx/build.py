"""The runner's way into the MLX engine: one function from a RunnerSpec to a ready engine."""

from __future__ import annotations

from collections.abc import Callable

from skulk.runner.spec import RunnerSpec
from skulk.types.instances import Sharding
from skulk.types.runners import RunnerPhase

from . import available, install_hint
from .engine import MlxEngine
from .ring import RingLink, connect


class MlxUnavailable(RuntimeError):
    """Placement put an MLX rank on a node that cannot run MLX (it advertised the engine, then lost it)."""


def build_mlx_engine(spec: RunnerSpec, on_phase: Callable[[RunnerPhase, str], None]) -> MlxEngine:
    reason = available()
    if reason is not None:
        raise MlxUnavailable(f"this node cannot run the MLX engine ({reason}); install it: {install_hint()}")
    shard = spec.shard
    quantize = shard.model_card.quantize_at_load
    if shard.world_size == 1:  # a single rank reports no phase changes, like the torch engine's single rank
        return MlxEngine(spec.model_dir, prefill_chunk=spec.prefill_chunk_tokens, quantize=quantize,
                         max_seq=spec.context_length)
    if len(spec.ring_hosts) != shard.world_size:
        raise MlxUnavailable(f"rank {shard.device_rank} has {len(spec.ring_hosts)} ring hosts for "
                             f"{shard.world_size} ranks")
    link = RingLink(connect(shard.device_rank, spec.ring_hosts))
    tensor = spec.sharding == Sharding.Tensor
    engine = MlxEngine(spec.model_dir, prefill_chunk=spec.prefill_chunk_tokens, quantize=quantize, link=link,
                       max_seq=spec.context_length,
                       layers=None if tensor else (shard.start_layer, shard.end_layer), tensor=tensor)
    engine.on_phase = on_phase
    return engine
