"""How fast a placement will decode, predicted before it is placed: pure, from measured compute and links.

Inputs are what nodes measured (types/links.py): each node's seconds per decode step per GB of weights at the
batches it has served (worker/compute.py) and each link's round trip and bandwidth (worker/links.py). The model:

- A rank's step at batch b costs its node's `step_s_per_gb(b)` times the weight GB it holds: a Pipeline rank its
  layers' share of the model, a Tensor rank 1/world of every layer. Decode streams every weight once per step,
  so the time follows the bytes (the lm_head is counted as a layer's share: a small error for models whose
  vocabulary is large against their layers, which only moves how the work splits between Pipeline stages).
- A hop costs one way of its link: half the measured round trip, the message's bytes over the bandwidth, and
  the engine's own work per message (PIPELINE_HOP_S, COLLECTIVE_STEP_S: measured with bench/split.py).
- One rank: its step, times the tokens per step its node measured (speculative drafts accepted; a split does
  not speculate, so one token per stream per step).
- Pipeline, one stream: every rank's step in turn, a hidden-state hop between consecutive ranks and the sampled
  token's hop back to rank 0. At batch B without micro-batches the same, at B. With PIPELINE_MICRO_BATCHES
  (one micro-batch per rank in flight) a round lets every rank work on every micro-batch once: it lasts the
  longer of the busiest rank's work and one micro-batch's trip round the ring.
- Tensor: every rank's share in parallel (the slowest sets the pace), two all-reduces per layer (after
  attention and after the MLP; a ring all-reduce over W ranks is 2(W-1) one-way steps), and the sampled tokens'
  broadcast.
A node that has not served yet borrows the median figure of the nodes that have (a cluster of like machines is
the common case); with no figure anywhere, or a link never measured, there is no prediction (None).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from skulk.types.ids import NodeId
from skulk.types.instances import Sharding
from skulk.types.links import DecodeCompute, LinkMeasurement
from skulk.types.models import ModelCard

PREDICTED_BATCH = 8
"""The batch `predicted_aggregate_tps` is for: 8 concurrent streams, the figure bench/split.py measures."""
PIPELINE_HOP_S = 0.0011
"""The torch engine's own cost per Pipeline message (hidden states to the next rank, tokens back to rank 0):
torch.distributed's send and receive, the step header, the Python around them. bench/split.py on an H200
host's CPU cores (one thread per rank, veth without added latency): Pipeline 2 decoded one stream at 4.75 ms a
token where a rank's plain step is about 2.5 ms, two messages a token. Checked again 2026-11-26 on a 2-core VM
with the pipelined schedule, 0.5 ms RTT emulated (SKULK_LINK_DELAY_MS), speculation off on both, load average ~9
(bench/split.py --links lan1g --cores 0/1): predicted ÷ measured one stream, Pipeline 2, -8 % (100M int4) and +6 %
(SmolLM2); one rank -1 % and +5 %. Kept: the figures do not say it is wrong, and a machine that loaded cannot
say more precisely what it is."""
COLLECTIVE_STEP_S = 0.0003
"""The engine's own cost per one-way step of a Tensor all-reduce (gloo, a few KB): the same run's Tensor 2,
17.5 ms a token for half the compute and 49 one-way steps (two all-reduces per layer, 12 layers). Not re-fitted
on the 2-core VM (2026-11-26, load ~9): there Tensor 2 predicted +50 % over measured, because each gloo
all-reduce waits for both ranks to be scheduled on a machine whose cores are shared by a dozen processes (about
1.8 ms a one-way step, bench/split_engine.py), which a LAN node with its own cores does not see."""
PIPELINE_MICRO_BATCHES = True
"""Whether the torch engine keeps one micro-batch per Pipeline rank in flight (issue 28's pipelined schedule,
engines/torch/flight.py, on since it landed): without it a batch crosses the ranks as one, and only one rank
computes at a time."""
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
    return _at(compute.step_s_per_gb, batch)


def tokens_per_step(compute: DecodeCompute, batch: int) -> float:
    """Tokens a stream gets per single-rank step at `batch` (accepted speculative drafts), 1 when unknown."""
    return max(_at(compute.tokens_per_step, batch) or 1.0, 1.0)


def _at(table: Mapping[int, float], batch: int) -> float | None:
    points = sorted(table.items())
    if not points:
        return None
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in pairwise(points):
        if b0 <= batch <= b1:
            return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
    if len(points) < 2:
        return None
    (b0, s0), (b1, s1) = points[-2], points[-1]
    return max(s1, s1 + (s1 - s0) * (batch - b1) / (b1 - b0))


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
              message_bytes: float, software_s: float = PIPELINE_HOP_S) -> float | None:
    """One message from a to b: half the round trip, the bytes over the bandwidth, the engine's own cost. The
    link as a measured it, else as b measured it (links are symmetric enough for this)."""
    link = links.get(a, {}).get(b) or links.get(b, {}).get(a)
    if link is None:
        return None
    wire = message_bytes * 8 / (link.bandwidth_mbps * 1e6) if link.bandwidth_mbps else 0.0
    return link.rtt_ms / 2000 + wire + software_s


def _pipeline_step_s(card: ModelCard, ranks: Sequence[RankShare], per_gb: Mapping[NodeId, float], rows: int,
                     links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]]) -> tuple[list[float], float] | None:
    """(each rank's compute seconds, the hops' seconds) for one pass of `rows` rows through the ring."""
    gb = card.storage_size.in_bytes / 1e9
    compute = [per_gb[r.node_id] * gb * r.layers / card.n_layers for r in ranks]
    hidden = card.hidden_size * rows * (4 if card.dtype == "float32" else 2)
    hops = 0.0
    for here, there in pairwise(ranks):
        cost = one_way_s(links, here.node_id, there.node_id, hidden)
        if cost is None:
            return None
        hops += cost
    if len(ranks) > 1:
        back = one_way_s(links, ranks[-1].node_id, ranks[0].node_id, TOKEN_ROW_BYTES * rows)
        if back is None:
            return None
        hops += back
    return compute, hops


def _pipeline_tps(card: ModelCard, ranks: Sequence[RankShare], per_gb: Mapping[NodeId, float], batch: int,
                  links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]],
                  micro_per_gb: Mapping[NodeId, float] | None) -> float | None:
    """`micro_per_gb`: the figures at a micro-batch's rows when the engine pipelines micro-batches, else None."""
    if micro_per_gb is not None:
        rows = math.ceil(batch / len(ranks))
        step = _pipeline_step_s(card, ranks, micro_per_gb, rows, links)
        if step is None:
            return None
        compute, hops = step
        round_s = max(len(ranks) * max(compute), sum(compute) + hops)
        return batch / round_s
    step = _pipeline_step_s(card, ranks, per_gb, batch, links)
    return None if step is None else batch / (sum(step[0]) + step[1])


def _tensor_tps(card: ModelCard, ranks: Sequence[RankShare], per_gb: Mapping[NodeId, float], batch: int,
                links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]]) -> float | None:
    world = len(ranks)
    gb = card.storage_size.in_bytes / 1e9
    compute = max(per_gb[r.node_id] * gb / world for r in ranks)
    if world == 1:
        return batch / compute
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
         batch: int, links: Mapping[NodeId, Mapping[NodeId, LinkMeasurement]], micro_batches: bool
         ) -> tuple[float | None, tuple[NodeId, ...]] | None:
    """(tok/s at `batch`, the nodes that borrowed a figure); None when no node has a figure for the batch."""
    nodes = [r.node_id for r in ranks]
    figures = _figures(nodes, compute, batch)
    if figures is None:
        return None
    per_gb, borrowed = figures
    if sharding == Sharding.Tensor:
        return _tensor_tps(card, ranks, per_gb, batch, links), borrowed
    micro = None
    if micro_batches and len(ranks) > 1 and batch >= len(ranks):
        at_rows = _figures(nodes, compute, math.ceil(batch / len(ranks)))
        if at_rows is None:
            return None
        micro = at_rows[0]
    rate = _pipeline_tps(card, ranks, per_gb, batch, links, micro)
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
    micro_batches: bool = PIPELINE_MICRO_BATCHES,
) -> SpeedPrediction | None:
    """One stream's and `batch` streams' decode tok/s for `ranks` (in rank order), or None when the cluster has
    not measured enough to say (no node has served, or a link of the ring was never measured)."""
    if not ranks or card.n_layers < 1:
        return None
    single = _tps(card, sharding, ranks, compute, 1, links, micro_batches)
    if single is None or single[0] is None:
        return None
    many = _tps(card, sharding, ranks, compute, batch, links, micro_batches)
    borrowed = tuple(dict.fromkeys(single[1] + (many[1] if many is not None else ())))
    aggregate = many[0] if many is not None else None
    return SpeedPrediction(decode_tps=single[0], aggregate_tps=aggregate, batch=batch, borrowed=borrowed)
