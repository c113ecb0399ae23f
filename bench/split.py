"""What splitting a model costs and gains when the ranks are separate machines: each rank a real node process in
its own network namespace, on its own core, over links of set latency and bandwidth.

Each node runs in a network namespace (`ip netns`), joined to one bridge in the root namespace by a veth pair,
pinned to one core (`taskset`) with one compute thread (OMP_NUM_THREADS=1, so torch runs one thread), and its
links shaped with `tc`: `netem delay` (a quarter of the RTT on each of the four egress points of a path, so a
round trip between two nodes crosses the whole RTT) with its `rate`, as
  lan10g  0.1 ms RTT / 10 Gbit,  lan1g  0.5 ms / 1 Gbit,  wifi  2 ms / 300 Mbit.
Where the kernel has no netem (the qdisc is unknown: Firecracker VMs), it shapes the rate with `tbf` and emulates
the latency in the engine (SKULK_LINK_DELAY_MS, engines/torch/delay.py: every rank-to-rank message is posted a
one-way delay after it was sent, by a thread, so the sender is not held; the nodes report the emulated round trip
so predictions see it). The nodes are started afresh under each link, since a runner reads the delay once.
Speculative decoding is off on every placement (SKULK_SPECULATE=0): a split never speculates, so one rank
drafting by prompt lookup would not be like for like.

For each model (the built-in ~100M `skulk/bench-random-100m` quantized to int4 at load, and SmolLM2-135M, the
default model, fetched as `make run` fetches it) it places one rank on one core, then Pipeline 2 and Tensor 2
(one core each), and under each link measures: single-stream decode tok/s (median of --streams), TTFT (median),
and the 8-stream aggregate (the sum of the 8 streams' own decode rates, each its usage's tokens after the first over
its first-to-last-token time, so the admission ramp does not dilute the batch's rate: steady_aggregate). Every
row prints its ratio to one rank measured under the same link in the same run, and the previews' predicted
tok/s for that placement (GET /instance/previews, read under that link before measuring) beside the measured.

Needs root (network namespaces, tc); without it, or where `ip netns add` fails, it says why and exits 0.

Measured 2026-11-26 on an H200 machine's host CPUs (16 cores; `--models bench --cores 2-3/4-5 --tokens 32`;
Firecracker kernel without netem, so the rates alone were shaped and every link had the veth's latency), one
stream ÷ one rank: Pipeline 2 0.57-0.60, Tensor 2 0.15; 8 streams ÷ one rank: Pipeline 2 0.48-1.28,
Tensor 2 0.31-0.64 (one rank decoded 369-385 tok/s, one stream; 366-465 tok/s, 8 streams; that run timed the
aggregate from the first first-token to the last token, ramp and tail included; one rank also speculated then).
Measured 2026-11-26 (afternoon) on the 2-core Firecracker VM, quiet (load 1.3-1.5, `--cores 0/1`, latency emulated,
speculation off everywhere, the 8-stream aggregate from the usage), after placement began balancing a Pipeline by
decode work (master/balance.py: SmolLM2 22 + 8 layers, its 8-bit lm_head on the last rank) and the runner's pipe
lost its thread hops (runner/channel.py). ÷ one rank under the same link, one stream / 8 streams, then the previews'
error (one stream / 8 streams), predictions read from live previews before measuring:
  0.1 ms RTT  100M int4  Pipeline 2 0.87 / 0.94 (-20 % / -19 %)  Tensor 2 0.06 / 0.15 (+12 % / -1 %)
              SmolLM2    Pipeline 2 1.07 / 1.19 (-22 % / -22 %)
  0.5 ms RTT  100M int4  Pipeline 2 0.75 / 0.85 (-16 % / -8 %)   Tensor 2 0.05 / 0.13 (+7 % / -4 %)
              SmolLM2    Pipeline 2 0.86 / 1.08 (-22 % / -12 %)
              700M int4  Pipeline 2 1.01 / 1.10 (-6 % / -15 %)   Tensor 2 0.38 / 0.48 (+6 % / +4 %)
  2 ms RTT    100M int4  Pipeline 2 0.51 / 0.87 (-6 % / -27 %)   Tensor 2 0.03 / 0.07 (+11 % / +6 %)
              SmolLM2    Pipeline 2 0.71 / 1.19 (-6 % / -25 %)
              700M int4  Pipeline 2 0.95 / 1.07 (-3 % / -12 %)   Tensor 2 0.26 / 0.31 (+1 % / -6 %)
One rank decoded (one stream / 8 streams) 100M int4 300-306 / 990-1006 tok/s, SmolLM2 128-161 / 505-537, 700M int4
25.3-25.5 / 143-148; one rank's own predictions -18..+16 % / -8..+14 %. 40 of the 42 cells are within ±25 %; the two
outside are 8 streams over Pipeline 2 at 2 ms, predicted too slow. The same morning, before the balance, SmolLM2's 8
streams over Pipeline 2 read 0.92-0.96 at every link. Tensor 2 loses everywhere here: ~2 gloo all-reduces per layer
at ~0.6-0.7 ms each of gloo's own cost (master/speed.py COLLECTIVE_STEP_S) outweigh half the compute of these
models, whatever the link. Single-stream figures move ±20 % between runs of identical processes (bench/node_path.py).
Run: sudo .venv/bin/python bench/split.py [--models bench,smollm2,bench700m] [--links lan10g,lan1g,wifi] [--tokens 48]
     [--streams 3] [--cores 0/1] [--save run.json]   (--cores: each node's cores, taskset lists separated by '/')
     sudo .venv/bin/python bench/split.py --engine-rows --models bench --links lan1g [--rounds 2] [--tokens 64]
         (Pipeline 2 through nodes against the engine alone, bench/split_engine.py's driver, on the same placement
         and link, micro-batches as decided and forced on, interleaved; prints "through nodes ÷ engine alone" and
         each process's CPU per token: bench/split_rows.py, with its measured table)
     .venv/bin/python bench/split.py --repredict run.json   (the saved run's rows, predicted again by this tree
     from the states the run predicted from: a change to the prediction checked against measured figures)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from skulk.engines.link_delay import DELAY_ENV  # torch-free: the bench itself never imports torch
from skulk.models.demo import BENCH_700M_MODEL_ID, BENCH_MODEL_ID
from skulk.models.packaged import DEFAULT_MODEL_ID, shared_cache
from skulk.testing.convergence import formed, state_of
from skulk.testing.nodes import LocalNode
from skulk.testing.streams import stream_chunk
from skulk.testing.waiting import wait_until

SUBNET = "10.28.0"
PROMPT = "Write a short story about a fox who learns to split a model across two machines."
STREAMS_AGGREGATE = 8


@dataclass(frozen=True)
class LinkProfile:
    name: str
    rtt_ms: float
    rate: str  # tc's notation
    rate_mbit: float


PROFILES = {
    "lan10g": LinkProfile("lan10g", 0.1, "10gbit", 10_000),
    "lan1g": LinkProfile("lan1g", 0.5, "1gbit", 1_000),
    "wifi": LinkProfile("wifi", 2.0, "300mbit", 300),
}
MODELS = {"bench": (str(BENCH_MODEL_ID), "int4"), "smollm2": (str(DEFAULT_MODEL_ID), None),
          "bench700m": (str(BENCH_700M_MODEL_ID), "int4")}
"""--models keys: bench700m (~720M, int4 at load, a token in tens of ms on one core) is the regime a split is for,
and not in the default list: each node generates its 2.9 GB of float32 weights on first placement."""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


class Namespaces:
    """One namespace per node on one bridge; links shaped on every veth end (both directions)."""

    def __init__(self, count: int) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.names = [f"sk{self.tag}n{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(count)]
        self.ends: list[tuple[str, str | None]] = []  # (device, namespace or None for root)
        self.netem: str | None = None  # why netem is unusable, None when it works
        self.bridge = f"skbr{self.tag}"

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, (ns, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            outside, inside = f"sk{self.tag}o{i}", f"sk{self.tag}i{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            sh("ip", "link", "set", inside, "netns", ns)
            sh("ip", "link", "set", outside, "master", self.bridge)
            sh("ip", "link", "set", outside, "up")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            sh("ip", "-n", ns, "link", "set", inside, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.ends += [(outside, None), (inside, ns)]

    def shape(self, profile: LinkProfile) -> None:
        """A quarter of the RTT on each egress: node→bridge and bridge→node, both ways round a path."""
        for dev, ns in self.ends:
            prefix = ["ip", "netns", "exec", ns] if ns else []
            if self.netem is None:
                qdisc = ["netem", "delay", f"{profile.rtt_ms / 4:.3f}ms", "rate", profile.rate, "limit", "100000"]
                done = sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc, check=False)
                if done.returncode == 0:
                    continue
                self.netem = done.stderr.strip() or f"tc exited {done.returncode}"
            burst = max(int(profile.rate_mbit * 1e6 / 8 / 250), 64 * 1024)  # a 4 ms bucket, at least 64 KiB
            sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", profile.rate,
               "burst", str(burst), "latency", "50ms")

    def down(self) -> None:
        for ns in self.names:
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)


class Loopback(Namespaces):
    """The fallback where namespaces are refused (--loopback-fallback): every node on 127.0.0.1, still each on
    its own cores with one compute thread, links not shaped (the one profile is named `loopback`)."""

    def __init__(self, count: int, why: str) -> None:
        super().__init__(count)
        self.names = [""] * count
        self.addresses = ["127.0.0.1"] * count
        self.netem = f"no namespaces ({why}): loopback, links not shaped"

    def up(self) -> None:
        pass

    def shape(self, profile: LinkProfile) -> None:
        pass

    def down(self) -> None:
        pass


def namespaces_refused() -> str | None:
    """Why this machine cannot run the bench (None when it can): root, ip, tc, taskset and a namespace."""
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc (run it with sudo)"
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"sk{uuid.uuid4().hex[:4]}probe"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class SplitNode(LocalNode):
    """A node whose every process lives in one namespace, on one core, with one compute thread."""

    address: str = "127.0.0.1"
    netns: str = ""
    cores: str = "0"
    """taskset's list: the node, its runner and the runner's one compute thread stay on these."""

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.api_port}"

    @property
    def endpoint(self) -> str:
        return f"tcp/{self.address}:{self.zenoh_port}"

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--api-host") + 1] = self.address
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        return [*inside, "taskset", "-c", self.cores, *cmd]


NODE_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
    "CUDA_VISIBLE_DEVICES": "",  # the CPU engine on every rank, also on a machine with a GPU
    "NO_PROXY": "*", "no_proxy": "*",
    "SKULK_LINK_BANDWIDTH_SECONDS": "3",  # a changed link's bandwidth is read again within seconds, not 30
    "SKULK_SPECULATE": "0",  # like for like: a split does not speculate, so one rank does not either
}


@dataclass
class Row:
    model: str
    link: str
    placement: str  # "1 rank", "Pipeline 2", "Tensor 2"
    decode: float
    ttft_ms: float
    aggregate: float
    predicted: tuple[float | None, float | None] = (None, None)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Streamed:
    sent: float
    times: list[float]
    """When each token line arrived."""
    produced: int

    @property
    def first(self) -> float:
        return self.times[0]

    @property
    def last(self) -> float:
        return self.times[-1]


async def one_stream(client: httpx.AsyncClient, model: str, tokens: int, seed: int) -> Streamed:
    """One greedy streamed completion, as its client saw it."""
    body = {"model": model, "messages": [{"role": "user", "content": f"{PROMPT} ({seed})"}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    seen = Streamed(time.perf_counter(), [], 0)
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            chunk = stream_chunk(line)
            if chunk is None:
                continue
            if chunk >= 0:
                seen.produced = chunk
                continue
            seen.times.append(time.perf_counter())
    if seen.produced < 2 or len(seen.times) < 2:
        raise RuntimeError(f"too few tokens streamed ({seen.produced})")
    return seen


def steady_aggregate(many: list[Streamed]) -> float:
    """Tokens/s of all streams together while they decode: the sum of each stream's own decode rate, its tokens
    after the first over the time from its first to its last token (the admission ramp and prefill left out).

    Tokens are counted from the usage, not from the lines that arrived: a line carries text, and a token that
    completes no character (a random model's partial UTF-8 bytes) sends none. The 100M random model's 8 streams
    sent 12-33 lines for 48 tokens each, so counting lines in the window where all 8 decoded read ~390 tok/s
    where the streams' tokens over the whole span, prefill included, were ~930. Each stream's rate assumes its
    tokens came evenly between its first and last (exact for a stream alone in a steady batch; streams admitted
    far apart would each run part of their time in a smaller, faster batch and read a little high)."""
    return sum((s.produced - 1) / (s.last - s.first) for s in many if s.last > s.first)


async def measure(url: str, model: str, tokens: int, streams: int) -> tuple[float, float, float]:
    """(single-stream decode tok/s, TTFT ms, 8-stream aggregate tok/s), medians of `streams` single streams."""
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
        await one_stream(client, model, 8, 0)  # warm-up
        singles = [await one_stream(client, model, tokens, i) for i in range(streams)]
        many = await asyncio.gather(*(one_stream(client, model, tokens, 100 + i) for i in range(STREAMS_AGGREGATE)))
    decode = statistics.median((s.produced - 1) / (s.last - s.first) for s in singles)
    ttft = statistics.median(s.first - s.sent for s in singles) * 1000
    return decode, ttft, steady_aggregate(list(many))


class Refused(Exception):
    """The cluster refused the placement with a 400: the bench says why and goes on with the next."""


def place(api: SplitNode, members: list[SplitNode], everyone: list[SplitNode], model: str, quant: str | None,
          sharding: str) -> tuple[str, set[str]]:
    body: dict[str, Any] = {"model_id": model, "sharding": sharding, "min_nodes": len(members), "engine": "torch",
                            "excluded_nodes": [n.node_id for n in everyone if n not in members]}
    if quant:
        body["quantization"] = quant
    with api.client(timeout=300) as client:
        reply = client.post("/place_instance", json=body)
    if reply.status_code == 400:  # the model cannot be split so (Tensor needs heads divisible by the ranks)
        raise Refused(reply.json().get("error", {}).get("message", reply.text))
    if reply.status_code != 200:
        raise RuntimeError(f"placement {sharding} on {len(members)} refused: {reply.text}")
    assignments = reply.json()["instance"]["MlxRingInstance"]["shardAssignments"]
    runners, node_ids = set(assignments["runnerToShard"]), set(assignments["nodeToRunner"])
    if node_ids != {n.node_id for n in members}:
        raise RuntimeError(f"asked for {[n.node_id for n in members]}, got {node_ids}")
    instance_id = reply.json()["instanceId"]

    def ready() -> bool:
        state = state_of(api)
        return state is not None and all("RunnerReady" in state["runners"].get(r, {}) for r in runners)

    wait_until(ready, 600, f"{sharding} on {len(members)} to be ready", poll=0.5)
    return instance_id, runners


def delete(api: SplitNode, instance_id: str, runners: set[str]) -> None:
    with api.client(timeout=60) as client:
        client.delete(f"/instance/{instance_id}").raise_for_status()

    def gone() -> bool:
        state = state_of(api)
        return state is not None and instance_id not in state["instances"] and not runners & set(state["runners"])

    wait_until(gone, 120, "the instance and its runners to go", poll=0.2)


def links_settled(api: SplitNode, nodes: list[SplitNode], after: float) -> bool:
    """Every node has reported every peer's link from samples taken after `after` (unix time)."""
    state = state_of(api)
    if state is None:
        return False
    reported = state.get("nodeLinks", {})
    return all((reported.get(a.node_id, {}).get(b.node_id) or {}).get("measuredAtS", 0) > after
               for a in nodes for b in nodes if a is not b)


def predictions(api: SplitNode, model: str, quant: str | None, members: list[SplitNode], sharding: str
                ) -> tuple[float | None, float | None]:
    params: dict[str, Any] = {"model_id": model, "sharding": sharding, **({"quantization": quant} if quant else {})}
    with api.client(timeout=60) as client:
        previews = client.get("/instance/previews", params=params).json().get("previews", [])
    wanted = {n.node_id for n in members}
    for preview in previews:
        nodes = set((preview.get("memory_delta_by_node") or {}).keys())
        if nodes == wanted and preview.get("error") is None:
            return preview.get("predicted_decode_tps"), preview.get("predicted_aggregate_tps")
    return None, None


PLACEMENTS = (("1 rank", 1, "Pipeline"), ("Pipeline 2", 2, "Pipeline"), ("Tensor 2", 2, "Tensor"))


def settle_and_predict(nodes: list[SplitNode], key: str, profile: LinkProfile
                       ) -> tuple[dict[str, tuple[float | None, float | None]], Any]:
    """Wait until both nodes reported links measured under this link (a bandwidth read included: they read every
    3 s here), and read every placement's prediction, before any of them is measured; with the state they were
    predicted from (--save keeps it, so --repredict can predict again from the same measured inputs)."""
    model, quant = MODELS[key]
    after = time.time() + 7
    try:
        wait_until(lambda: links_settled(nodes[0], nodes, after), 45, "link measurements", poll=0.5)
    except (TimeoutError, AssertionError, RuntimeError) as exc:  # predict from what is there, and say so
        print(f"  links under {profile.name} not all re-measured in 45 s ({exc}); predictions may be stale")
    state = state_of(nodes[0])
    return {label: predictions(nodes[0], model, quant, nodes[:count], sharding)
            for label, count, sharding in PLACEMENTS}, state


def _state(model: Any, wire: dict[str, Any]) -> Any:
    """GET /state's document as a State: what the API adds beyond the State model (views for clients) dropped."""
    from pydantic import ValidationError

    while True:
        try:
            return model.model_validate(wire)
        except ValidationError as exc:
            extra = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not extra:
                raise
            for loc in extra:
                parent: Any = wire
                for key in loc[:-1]:
                    parent = parent[key]
                parent.pop(loc[-1], None)


def repredict(row: Row) -> tuple[float | None, float | None]:
    """The row's placement predicted again, by this tree's master/speed.py, from the state saved when the run
    predicted it (the same path as GET /instance/previews)."""
    from skulk.api.previews import skulk_previews
    from skulk.models.cards import get_card, with_quantization
    from skulk.types.instances import InstanceMeta, Sharding
    from skulk.types.placement import KvSizing
    from skulk.types.state import State

    model, quant = MODELS[row.model]
    state, members = _state(State, row.extra["state"]), row.extra["members"]
    card = get_card(model)
    assert card is not None, model
    card = with_quantization(card, quant) if quant else card
    excluded = set(state.topology.nodes) - set(members)
    found = skulk_previews(state, card, [Sharding(row.extra["sharding"])], list(InstanceMeta), excluded,
                           "torch", KvSizing())
    for preview in found:
        if set(preview.memory_delta_by_node or {}) == set(members) and preview.error is None:
            return preview.predicted_decode_tps, preview.predicted_aggregate_tps
    return None, None


def run_model(nodes: list[SplitNode], key: str, profile: LinkProfile, tokens: int, streams: int) -> list[Row]:
    """One rank first (its requests teach node 0 its compute; every placement's prediction is read while it is
    placed), then Pipeline 2 and Tensor 2, under the one link the nodes run on."""
    model, quant = MODELS[key]
    api, rows = nodes[0], []
    predicted: dict[str, tuple[float | None, float | None]] = {}
    state: Any = None
    for label, count, sharding in PLACEMENTS:
        try:
            instance_id, runners = place(api, nodes[:count], nodes, model, quant, sharding)
        except Refused as exc:
            print(f"  {key:8} {label:10} not measured: {exc}", flush=True)
            continue
        try:
            # warm-up, 1 and 8 streams (first-call allocations); on one rank these served steps also teach
            # node 0 its compute before anything is predicted
            asyncio.run(measure(api.url, model, tokens if count == 1 else 8, 2 if count == 1 else 1))
            if count == 1:
                predicted, state = settle_and_predict(nodes, key, profile)
            decode, ttft, aggregate = asyncio.run(measure(api.url, model, tokens, streams))
            guess = predicted.get(label, (None, None))
            inputs = {"state": state, "members": [n.node_id for n in nodes[:count]], "sharding": sharding}
            rows.append(Row(key, profile.name, label, decode, ttft, aggregate, guess, inputs))
            print(f"  {key:8} {profile.name:7} {label:10} decode {decode:7.1f}  ttft {ttft:7.1f} ms  "
                  f"8-stream {aggregate:7.1f}  predicted {guess}", flush=True)
        finally:
            delete(api, instance_id, runners)
    return rows


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ratio(value: float | None, base: float) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def within(predicted: float | None, measured: float) -> str:
    """The prediction's error against the measured figure, and whether it is within the ±25 % target."""
    if predicted is None or not measured:
        return "-"
    error = predicted / measured - 1
    return f"{error:+.0%}{'' if abs(error) <= PREDICTION_TARGET else '!'}"


PREDICTION_TARGET = 0.25


def print_table(rows: list[Row]) -> None:
    base = {(r.model, r.link): r for r in rows if r.placement == "1 rank"}
    print(f"\n{'model':8} {'link':7} {'placement':10} | {'decode':>7} {'÷1':>5} {'pred':>6} {'err':>5} | "
          f"{'ttft ms':>7} {'÷1':>5} | {'8-str':>7} {'÷1':>5} {'pred':>6} {'err':>5}")
    for r in rows:
        one = base.get((r.model, r.link), r)
        pd, pa = r.predicted
        print(f"{r.model:8} {r.link:7} {r.placement:10} | {r.decode:7.1f} {ratio(r.decode, one.decode):>5} "
              f"{fmt(pd):>6} {within(pd, r.decode):>5} | {r.ttft_ms:7.1f} {ratio(r.ttft_ms, one.ttft_ms):>5} | "
              f"{r.aggregate:7.1f} {ratio(r.aggregate, one.aggregate):>5} {fmt(pa):>6} {within(pa, r.aggregate):>5}")
    print(f"÷1: against one rank under the same link in this run; err: predicted (GET /instance/previews, read "
          f"before measuring) against measured, '!' beyond the ±{PREDICTION_TARGET:.0%} target")


def start_nodes(ns: Namespaces, root: Path, cores: list[str], profile: LinkProfile,
                extra: dict[str, str] | None = None) -> list[SplitNode]:
    """The nodes for one link: under emulated latency (no netem) each runner reads the delay once, at its start.
    extra: more environment for the nodes and their runners (--engine-rows: SKULK_MICRO_BATCHES)."""
    cluster = f"split{uuid.uuid4().hex[:6]}"
    env = {**NODE_ENV, "SKULK_MODEL_CACHE": str(shared_cache()), **(extra or {})}
    if emulated(ns):
        env[DELAY_ENV] = f"{profile.rtt_ms / 2:g}"
    nodes: list[SplitNode] = []
    for i, (name, address) in enumerate(zip(ns.names, ns.addresses, strict=True)):
        node = SplitNode(home=root / f"node{i}", cluster=cluster, peers=[n.endpoint for n in nodes], extra_env=env,
                      address=address, netns=name, cores=cores[i])
        nodes.append(node.start())
    for node in nodes:
        node.wait_ready(120)
    wait_until(lambda: formed(nodes), 120, "the nodes to form one cluster", poll=0.2)
    return nodes


def emulated(ns: Namespaces) -> bool:
    """Latency emulated in the engine: the kernel has no netem (not on the loopback fallback, which shapes nothing)."""
    return ns.netem is not None and not isinstance(ns, Loopback)


def shaping_of(ns: Namespaces) -> str:
    if isinstance(ns, Loopback):
        return str(ns.netem)
    if ns.netem is None:
        return "netem delay+rate"
    return (f"tbf rate, latency emulated in the engine ({DELAY_ENV}: rank-to-rank messages only, not HTTP; "
            f"netem: {ns.netem})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bench,smollm2")
    parser.add_argument("--links", default="lan10g,lan1g,wifi")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--cores", default="0/1",
                        help="each node's cores as taskset lists, '/' between nodes: 0/1, or 2-3/4-5 to give each "
                             "node process a core beside its runner's one compute thread")
    parser.add_argument("--loopback-fallback", action="store_true",
                        help="where namespaces are refused, still measure: nodes on loopback, each on its cores")
    parser.add_argument("--engine-rows", action="store_true",
                        help="instead: Pipeline 2 through nodes against the engine alone (split_engine.py's driver) "
                             "on the same placement, micro-batches as decided and forced on, interleaved "
                             "(split_rows.py); one link (the first of --links), --rounds rounds")
    parser.add_argument("--rounds", type=int, default=2, help="with --engine-rows: alternating rounds")
    parser.add_argument("--save", type=Path, help="write the rows and the state each prediction came from (JSON)")
    parser.add_argument("--repredict", type=Path,
                        help="measure nothing: predict a --save file's rows again with this tree's master/speed.py")
    args = parser.parse_args()
    if args.repredict:
        saved = [Row(**r) for r in json.loads(args.repredict.read_text())]
        print_table([dataclasses.replace(r, predicted=repredict(r)) for r in saved])
        print(f"predicted again by this tree from the states saved in {args.repredict}")
        return
    refused = namespaces_refused()
    if refused is not None and not (args.loopback_fallback and shutil.which("taskset")):
        print(f"bench/split.py: {refused}; nothing measured.")
        return
    cores = args.cores.split("/")
    profiles = [PROFILES[name] for name in args.links.split(",")]
    ns = Namespaces(2) if refused is None else Loopback(2, refused)
    if refused is not None:
        profiles = [LinkProfile("loopback", 0.0, "-", 0)]
    if args.engine_rows:
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        import split_rows

        try:
            ns.up()
            ns.shape(profiles[0])
            print(f"{profiles[0].name}: {shaping_of(ns)}", flush=True)
            split_rows.run(sys.modules[__name__], ns, cores, profiles[0], args.models.split(","), args.tokens,
                           args.rounds)
        finally:
            ns.down()
        return
    nodes: list[SplitNode] = []
    rows: list[Row] = []
    try:
        ns.up()
        with tempfile.TemporaryDirectory() as tmp:
            for profile in profiles:
                ns.shape(profile)
                print(f"{profile.name}: {shaping_of(ns)}", flush=True)
                nodes = start_nodes(ns, Path(tmp) / profile.name, cores, profile)
                try:
                    for key in args.models.split(","):
                        rows += run_model(nodes, key, profile, args.tokens, args.streams)
                finally:
                    for node in nodes:
                        node.stop()
                    for node in nodes:
                        node.reap_leftovers()
    finally:
        ns.down()
    print(f"\n{args.tokens} tokens, median of {args.streams} single streams, {STREAMS_AGGREGATE}-stream aggregate; "
          f"one compute thread per node (cores {cores}); speculative decoding off on every placement "
          f"(SKULK_SPECULATE=0: like for like); links: {shaping_of(ns)}; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_table(rows)
    if args.save:
        args.save.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))


if __name__ == "__main__":
    main()
