"""How fast a placement will decode, predicted before it is placed: pure, from measured compute and links.

Inputs are what nodes measured (types/links.py): each node's seconds per decode step per GB of weights at the
batches it has served (worker/compute.py) and each link's round trip and bandwidth (worker/links.py). The model:

- A rank's step at batch b costs its node's `step_s_per_gb(b)` times the weight GB it holds: a Pipeline rank its
  share of the bytes a decode step reads (balance.rank_work: its layers', and on the last rank the lm_head's and
  final norm's; the embedding is a gather), a Tensor rank 1/world of every layer. Decode streams every weight
  once per step, so the time follows the bytes; the shares add up to the whole model, which is what a node's
  figure was learned on. A split's ranks on the sampler's node and on the serving node also pay the node path's
  extra work per token (SPLIT_TOKEN_S), which shares their cores.
- A hop costs one way of its link: half the measured round trip, the message's bytes over the bandwidth, and
  the engine's own work per message (PIPELINE_HOP_S, COLLECTIVE_STEP_S: measured with bench/split.py).
- One rank: its step, times the tokens per step its node measured (speculative drafts accepted; a split does
  not speculate, so one token per stream per step).
- Pipeline, one stream: every rank's step in turn, a hidden-state hop between consecutive ranks and the sampled
  token's hop back to rank 0. At batch B the engine keeps one micro-batch per rank in flight only where that
  round is shorter than the plain step, and the prediction takes the same decision with the same function
  (engines/micro_batching.py) from the same kind of figures: the plain step is every rank's step at B in turn
  plus the hops; a micro-batched round lets every rank work on every micro-batch once and lasts the longer of
  the busiest rank's work and one micro-batch's trip round the ring.
- Tensor: every rank's share in parallel (the slowest sets the pace), two all-reduces per layer (after
  attention and after the MLP; a ring all-reduce over W ranks is 2(W-1) one-way steps), and the sampled tokens'
  broadcast.
A node that has not served yet borrows the median figure of the nodes that have (a cluster of like machines is
the common case); with no figure anywhere, or a link never measured, there is no prediction (None).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from skulk.engines.micro_batching import Hops, Shares, at_rows, micro_batches_for, period_s
from skulk.master.balance import decode_bytes, rank_work
from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.links import DecodeCompute, LinkMeasurement
from skulk.types.models import ModelCard

PREDICTED_BATCH = 8
"""The batch `predicted_aggregate_tps` is for: 8 concurrent streams, the figure bench/split.py measures."""
PIPELINE_HOP_S = 0.0003
"""The torch engine's own cost per Pipeline message (hidden states to the next rank, tokens back to rank 0):
torch.distributed's send and receive, the step header, the Python around them. Fitted 2026-11-26 on a quiet 2-core
VM (load ~1.3, one core per node, speculation off, bench/split.py, latency emulated): 0.5 ms on the first run's
one-stream rows, then 0.3 ms over all five quiet runs' 15 Pipeline 2 one-stream rows at 0.1, 0.5 and 2 ms RTT (both
models): mean error -12 % (-15 % with 0.5 ms), every row but one within ±25 %; the one (100M int4, 0.1 ms, -31 %) is
its one-rank figure's own -19 %. (1.1 ms before, from an H200 host's veth without added latency, read the links'
round trip from one end only; see one_way_s.)"""
COLLECTIVE_STEP_S = 0.0007
"""The engine's own cost per one-way step of a Tensor all-reduce (gloo, a few KB). Fitted on the same quiet run's
Tensor 2 one stream at 0.5 ms RTT (100M int4: 17.2 tok/s, +1 %), then out of sample +6 % at 0.1 ms and -1 % at
2 ms RTT. A gloo all_reduce of 8 x 576 floats between two pinned processes costs ~1 ms wall, 0.7 ms CPU on this
machine (load ~3), so the figure is gloo's own, not the link's: Tensor 2 decoded 17.1 tok/s at 0.1 ms RTT and
17.2 at 0.5 ms."""
SPLIT_TOKEN_S = 0.0002
"""CPU a split adds per generated token on the node of its sampler (the last rank: the token's chunk forwarded
over zenoh) and on the node serving the request (taken to hold rank 0: the chunk received from zenoh, not a local
pipe), on top of what one rank's node spends (SSE to the client), which the node's learned step already holds.
It shares the ranks' cores (a runner computes on every core but the node's own work), so it counts in those
ranks' parts. bench/node_path.py, 2-core VM, 8 streams (load 7-11, HandOver): Pipeline 2's API node 0.62 ms a
token against one rank's 0.37, the sampler's node 0.35 against an idle node's 0.21."""
SPECULATES_ON_ONE_RANK = True
"""The torch engine drafts speculatively (prompt lookup) on a single rank only: a one-rank placement gets the
tokens per step its node measured, a split one token per stream per step."""
TOKEN_ROW_BYTES = 24
"""One sampled-token row on the wire: [token, finished, failed] as int64."""


@dataclass(frozen=True)
class RankShare:
    node_id: NodeId
    layers: int


@dataclass(frozen=True)
class SpeedPrediction:
    decode_tps: float
    """One stream."""
    aggregate_tps: float | None
    """All streams together at `batch`; None when no node has served a batch that large or near it."""
    batch: int
    borrowed: tuple[NodeId, ...] = ()
    """Nodes that had not served yet and were given the measured nodes' figure."""


def step_s_per_gb(compute: DecodeCompute, batch: int) -> float | None:
    """The node's figure at `batch`: measured, else linear between the batches around it (below the smallest
    measured, the smallest's; above the largest, extended from the two largest; from one batch alone, only
    batch 1 down)."""
    return at_rows(compute.step_s_per_gb, batch)


def tokens_per_step(compute: DecodeCompute, batch: int) -> float:
    """Tokens a stream gets per single-rank step at `batch` (accepted speculative drafts), 1 when unknown."""
    return max(at_rows(compute.tokens_per_step, batch) or 1.0, 1.0)


def _figures(nodes: Sequence[NodeId], compute: Mapping[NodeId, DecodeCompute], batch: int
             ) -> tuple[dict[NodeId, float], tuple[NodeId, ...]] | None:
    """Each node's seconds per GB at `batch`, the measured median for nodes without their own."""
    measured = {n: f for n, c in compute.items() if (f := step_s_per_gb(c, batch)) is not None}
    if not measured:
        return None
    fallback = statistics.median(measured.values())
    borrowed = tuple(n for n in nodes if n not in measured)
    return {n: measured.get(n, fallback) for n in nodes}, borrowed


def one_way_s(links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]], a: NodeId, b: NodeId,
              message_bytes: float, software_s: float | None = None) -> float | None:
    """One message from a to b: half the round trip, the bytes over the bandwidth, the engine's own cost
    (software_s; PIPELINE_HOP_S by default). The bandwidth as a measured it, else as b did; the round trip the
    shorter of the two ends' (the same link: a longer figure is a probe answered late, e.g. by a node busy with a
    runner on its core; bench/split.py's 0.5 ms link read 3.76 ms from one end and 0.85 ms from the other)."""
    ends = [m for m in (links.get(a, {}).get(b), links.get(b, {}).get(a)) if m is not None]
    if not ends:
        return None
    link = ends[0]
    rtt_ms = min(m.rtt_ms for m in ends)  # a probe's round trip only errs long (a busy node answers late)
    wire = message_bytes * 8 / (link.bandwidth_mbps * 1e6) if link.bandwidth_mbps else 0.0
    return rtt_ms / 2000 + wire + (PIPELINE_HOP_S if software_s is None else software_s)


def _ring(card: ModelCard, ranks: Sequence[RankShare], compute: Mapping[NodeId, DecodeCompute],
          links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]]) -> tuple[Shares, Hops]:
    """Each rank's seconds at r rows (its node's figure at r times its share of the bytes a step reads; a node without
    a figure borrows the median of those that have one) and the hops' seconds at r rows, as micro_batching wants."""
    gb = card.storage_size.in_bytes / 1e9
    width = 4 if card.dtype == "float32" else 2
    work = rank_work(decode_bytes(card), [r.layers for r in ranks])
    total = max(1, sum(work))

    def shares(rows: int) -> list[float] | None:
        figures = _figures([r.node_id for r in ranks], compute, rows)
        if figures is None:
            return None
        each = [figures[0][r.node_id] * gb * w / total for r, w in zip(ranks, work, strict=True)]
        if len(ranks) > 1:  # the node path's own work per token that a split adds (SPLIT_TOKEN_S)
            each[0] += rows * SPLIT_TOKEN_S
            each[-1] += rows * SPLIT_TOKEN_S
        return each

    def hops(rows: int) -> float | None:
        costs = [one_way_s(links, here.node_id, there.node_id, card.hidden_size * rows * width)
                 for here, there in pairwise(ranks)]
        if len(ranks) > 1:
            costs.append(one_way_s(links, ranks[-1].node_id, ranks[0].node_id, TOKEN_ROW_BYTES * rows))
        return None if any(c is None for c in costs) else sum(c for c in costs if c is not None)

    return shares, hops


def _pipeline_tps(card: ModelCard, ranks: Sequence[RankShare], compute: Mapping[NodeId, DecodeCompute], batch: int,
                  links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]], micro: bool | None) -> float | None:
    """micro: True, micro-batches whenever there are rows enough; False, never; None, as the engine decides
    (micro_batching.micro_batches_for, from the same figures)."""
    shares, hops = _ring(card, ranks, compute, links)
    world = len(ranks)
    if micro is None:
        count = micro_batches_for(shares, hops, batch, world) or 1
    else:
        count = world if micro and batch >= world else 1
    period = period_s(shares, hops, batch, count)
    return None if period is None else batch / period


def _tensor_tps(card: ModelCard, ranks: Sequence[RankShare], per_gb: Mapping[NodeId, float], batch: int,
                links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]]) -> float | None:
    world = len(ranks)
    gb = card.storage_size.in_bytes / 1e9
    compute = max(per_gb[r.node_id] * gb / world for r in ranks)
    if world == 1:
        return batch / compute
    compute += batch * SPLIT_TOKEN_S  # every rank waits in each collective for the busiest (SPLIT_TOKEN_S)
    partial = card.hidden_size * batch * 4
    ring = zip(ranks, [*ranks[1:], ranks[0]], strict=True)
    steps = [one_way_s(links, a.node_id, b.node_id, partial / world, COLLECTIVE_STEP_S) for a, b in ring]
    sampler = ranks[-1].node_id
    broadcast = [one_way_s(links, sampler, r.node_id, TOKEN_ROW_BYTES * batch, COLLECTIVE_STEP_S)
                 for r in ranks[:-1]]
    if any(s is None for s in steps) or any(b is None for b in broadcast):
        return None
    ring_step = max(s for s in steps if s is not None)
    all_reduce = 2 * (world - 1) * ring_step
    collectives = 2 * card.n_layers * all_reduce + max(b for b in broadcast if b is not None)
    return batch / (compute + collectives)


def _tps(card: ModelCard, sharding: Sharding, ranks: Sequence[RankShare], compute: Mapping[NodeId, DecodeCompute],
         batch: int, links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]], micro_batches: bool | None
         ) -> tuple[float | None, tuple[NodeId, ...]] | None:
    """(tok/s at `batch`, the nodes that borrowed a figure); None when no node has a figure for the batch."""
    nodes = [r.node_id for r in ranks]
    figures = _figures(nodes, compute, batch)
    if figures is None:
        return None
    per_gb, borrowed = figures
    if sharding == Sharding.Tensor:
        return _tensor_tps(card, ranks, per_gb, batch, links), borrowed
    rate = _pipeline_tps(card, ranks, compute, batch, links, micro_batches)
    if rate is not None and len(ranks) == 1 and SPECULATES_ON_ONE_RANK:
        own = compute.get(ranks[0].node_id)
        measured = [c for c in compute.values() if c.tokens_per_step]
        source = own if own is not None and own.tokens_per_step else (measured[0] if measured else None)
        rate *= tokens_per_step(source, batch) if source is not None else 1.0
    return rate, borrowed


def predict_speed(
    card: ModelCard,
    sharding: Sharding,
    ranks: Sequence[RankShare],
    compute: Mapping[NodeId, DecodeCompute],
    links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]],
    *,
    batch: int = PREDICTED_BATCH,
    micro_batches: bool | None = None,
) -> SpeedPrediction | None:
    """One stream's and `batch` streams' decode tok/s for `ranks` (in rank order), or None when the cluster has
    not measured enough to say (no node has served, or a link of the ring was never measured). micro_batches: a
    Pipeline's micro-batches always (True), never (False), or as the engine decides from the same figures (None,
    micro_batching.micro_batches_for)."""
    if not ranks or card.n_layers < 1:
        return None
    single = _tps(card, sharding, ranks, compute, 1, links, micro_batches)
    if single is None or single[0] is None:
        return None
    many = _tps(card, sharding, ranks, compute, batch, links, micro_batches)
    borrowed = tuple(dict.fromkeys(single[1] + (many[1] if many is not None else ())))
    aggregate = many[0] if many is not None else None
    return SpeedPrediction(decode_tps=single[0], aggregate_tps=aggregate, batch=batch, borrowed=borrowed)
