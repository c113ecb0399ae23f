"""What a node has measured of its links to its peers and of its own decode speed: the inputs of the speed
prediction placement previews carry (master/speed.py)."""

from __future__ import annotations

from .base import CamelModel

RTT_FLOOR_MS = 0.01
"""The least network round trip reported: two processes on one machine still cross a kernel."""
LINK_PROBE_MAX_BYTES = 4 * 1024 * 1024
"""The most GET /node/link_probe serves in one answer (a peer's bandwidth read asks for far less)."""


class LinkMeasurement(CamelModel):
    """This node's view of its link to one peer, from the topology probes it sends anyway (every second) and a
    small bulk read now and then."""

    rtt_ms: float
    """The network's round trip: the median of the last few `/node_id` probes to the peer (kept-alive HTTP)
    less the median of the same probe to this node itself, which is what the two HTTP stacks cost on their own
    (at least RTT_FLOOR_MS)."""
    probe_rtt_ms: float
    """The probes' own median round trip, HTTP stacks included (what a small API call between them costs)."""
    bandwidth_mbps: float | None = None
    """Megabits per second of the last bulk read (GET /node/link_probe), its round trip taken off; None until
    one was read."""
    measured_at_s: float
    """Unix time of the newest sample (so a reader can tell a fresh figure from a stale one)."""


class DecodeCompute(CamelModel):
    """How fast this node decodes, learned from the steps its single-rank runners served: seconds per decode
    step per GB of the model's weights, for each batch (streams in one step) it has seen. Learned, not
    calibrated: it is the real engine (kernels, attention, sampling, the runner's own per-step cost) on the
    node's real load, and it costs nothing at start-up."""

    step_s_per_gb: dict[int, float] = {}
    tokens_per_step: dict[int, float] = {}
    """Tokens each stream got per step, by batch: above 1 where the single-rank engine's speculative drafts
    (prompt lookup) were accepted; a multi-rank instance does not speculate."""
    steps: int = 0
    """Steps the figures were learned from."""
    calibrated: bool = False
    """The figures come from the start-up calibration (worker/calibrate.py: the decode kernels alone, so a step
    predicted from them is a little short), not from served steps; the first served steps replace them."""
