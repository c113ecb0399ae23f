"""Where a decode step's time goes as the batch grows: bench/paged.py --profile prints a table of ms per part of one
decode step at 1, 8, 16 and 32 streams on the 100M int4 model, to say where many streams ÷ one saturates and why.

Parts of engine.step(), timed in place (wrapped methods of the engine's parts): the scheduler's header (`sched`), the
decode rows' block tables and positions (`rows`), the forward pass (`fwd`), sampling and detokenising (`sample`),
and moving rows on and sharing tokens (`advance`). Inside the forward pass, which is one kernel call for every
layer, each part is timed alone on the same shapes: the embedding, the four projections of all 12 layers (`qkv`,
`o`, `gate_up`, `down`: the int4 matmuls, weights warm in cache), decode attention over the paged blocks of every
layer at the streams' positions (`attn`) and the final norm + lm_head (`head`); `other` is the forward pass less
those (norms, rope and cache writes, activation, and the matmuls' extra time reading the weights from DRAM).
`mm/row`: the matmuls' ms per stream, which falls while a step is bound by reading the weights and levels off
where it becomes bound by the multiply-adds.

The clock is the process's CPU time (time.thread_time: the bench runs one thread) so other load on a shared machine
does not count; memory stalls still do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from skulk.engines.torch import cpu_kernels
from skulk.engines.torch.engine import TorchEngine
from skulk.types.chat import SamplingParams

BATCHES = (1, 8, 16, 32)
WRAPPED = {"_lead": ("admission", "lead"), "_decode_rows": ("stepper", "decode_rows"),
           "_forward": ("executor", "forward"), "_advance": ("stepper", "advance"), "_accept": ("stepper", "accept"),
           "_share_tokens": ("stepper", "share_tokens")}
"""Each timed part of a step: its column, and the engine's part and method that computes it."""
STEPS = 20


def _timed(fn: Callable[[], Any], n: int = 15) -> float:
    """Median CPU ms of fn."""
    fn()
    samples = []
    for _ in range(n):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples) * 1e3


def _wrap(engine: TorchEngine, totals: dict[str, float]) -> None:
    for name, (part_name, method_name) in WRAPPED.items():
        part = getattr(engine, part_name)
        method = getattr(part, method_name)

        def timed(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.thread_time() - start

        setattr(part, method_name, timed)


def fill(engine: TorchEngine, streams: int) -> None:
    """Add `streams` 16-token prompts and step until every one is admitted and past its prompt: a burst is admitted
    over several steps (the scheduler keeps chunks small while rows decode), so each may decode up to the
    engine's context (empty() ends them)."""
    for i in range(streams):
        engine.add_request(f"p{streams}-{i}", [258, *range(40 + i, 55 + i)],
                           SamplingParams(max_tokens=engine.context_length - 16, temperature=0))
    while engine.queued or any(r.length < len(r.prompt) for r in engine._running):
        engine.step()
    assert len(engine._running) == streams


def empty(engine: TorchEngine) -> None:
    """Cancel every running request and step until they are gone."""
    for req in list(engine._running):
        engine.cancel(req.request_id)
    while engine.has_work():
        engine.step()


def _inside_forward(engine: TorchEngine, streams: int) -> dict[str, float]:
    """The forward pass's parts, each alone on this step's shapes (see the module docstring)."""
    model = engine.model
    assert model.embed_tokens is not None and model.norm is not None and model.lm_head is not None
    norm, head = model.norm, model.lm_head
    ids = torch.full((streams, 1), 65)
    x = model.embed_tokens(ids)
    parts = {"embed": _timed(lambda: model.embed_tokens(ids)),  # type: ignore[misc]
             "head": _timed(lambda: head(norm(x)).float())}
    hidden = torch.randn(streams, 1, model.args.hidden_size).to(x.dtype)
    inner = torch.randn(streams, 1, model.args.intermediate_size).to(x.dtype)
    calls = {"qkv": lambda layer: layer.self_attn.qkv(hidden), "o": lambda layer: layer.self_attn.o_proj(hidden),
             "gate_up": lambda layer: layer.mlp.gate_up(hidden), "down": lambda layer: layer.mlp.down_proj(inner)}
    for name, call in calls.items():
        parts[name] = sum(_timed(lambda layer=layer, call=call: call(layer)) for layer in model.layers.values())
    running = engine._running
    positions = torch.tensor([[r.length - 1] for r in running])
    width = max(len(r.table) for r in running)
    tables = torch.tensor([r.table + [0] * (width - len(r.table)) for r in running], dtype=torch.int32)
    cache = engine.cache.layers[0]
    args = model.args
    q = torch.randn(streams, args.num_attention_heads, 1, args.head_dim).to(cache.keys.dtype)
    parts["attn"] = len(model.layers) * _timed(
        lambda: cpu_kernels.decode_attention(q, cache.keys, cache.values, positions, tables, 0, args.head_dim**-0.5))
    return parts


def profile(engine: TorchEngine) -> list[dict[str, float]]:
    """A row of ms per part of a decode step per batch size (the engine: speculation off, EOS never ends a row)."""
    totals: dict[str, float] = {}
    _wrap(engine, totals)
    fill(engine, 1)  # first touches of the weights and the pool's pages, untimed
    for _ in range(20):
        engine.step()
    empty(engine)
    rows = []
    for streams in BATCHES:
        fill(engine, streams)
        for _ in range(3):
            engine.step()
        totals.clear()
        steps = []
        for _ in range(STEPS):
            start = time.thread_time()
            engine.step()
            steps.append(time.thread_time() - start)
        row = {"batch": streams, "step": statistics.median(steps) * 1e3,
               **{name: totals.get(name, 0.0) / STEPS * 1e3 for name in WRAPPED}}
        row.update(_inside_forward(engine, streams))
        row["context"] = statistics.mean(r.length for r in engine._running)
        rows.append(row)
        empty(engine)
    return rows


def print_table(rows: list[dict[str, float]]) -> None:
    matmuls = ("qkv", "o", "gate_up", "down")
    print(f"{'batch':>5} {'step':>6} {'sched':>5} {'rows':>5} {'fwd':>6} {'embed':>5} {'qkv':>5} {'o':>5} "
          f"{'gate_up':>7} {'down':>5} {'attn':>5} {'head':>5} {'other':>5} {'sample':>6} {'advance':>7} "
          f"{'mm/row':>6} {'ctx':>4}")
    for r in rows:
        mm = sum(r[name] for name in matmuls)
        other = r["_forward"] - mm - r["attn"] - r["embed"] - r["head"]
        print(f"{r['batch']:5.0f} {r['step']:6.2f} {r['_lead']:5.2f} {r['_decode_rows']:5.2f} {r['_forward']:6.2f} "
              f"{r['embed']:5.2f} {r['qkv']:5.2f} {r['o']:5.2f} {r['gate_up']:7.2f} {r['down']:5.2f} "
              f"{r['attn']:5.2f} {r['head']:5.2f} {other:5.2f} {r['_accept']:6.2f} "
              f"{r['_advance'] + r['_share_tokens']:7.2f} {mm / r['batch']:6.3f} {r['context']:4.0f}")
