"""`skulk diag`: the cluster timeline as a terminal table, stuck ranks highlighted.

For the person debugging a hang at 3 a.m.: one row per runner, ranks of an instance adjacent, and a red row
for a rank that waits at a barrier while its peers are elsewhere. `--watch` redraws every `--interval` s.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from skulk.diagnostics.clock import utc_now
from skulk.diagnostics.warnings import (
    BARRIER_PHASES,
    DEFAULT_THRESHOLDS,
    Thresholds,
    rank_disagreement,
)
from skulk.types.diagnostics_bundle import ClusterTimeline, ClusterTimelineRunner, DiagnosticWarning
from skulk.types.state import State

TIMELINE_PATH = "/v1/diagnostics/cluster/timeline"
STUCK_CODES = {"rank_disagreement", "phase_stuck"}
STUCK_STYLE = "bold red"
PEER_STYLE = "yellow"


def _flags(
    timeline: ClusterTimeline, now: datetime, th: Thresholds
) -> tuple[list[DiagnosticWarning], set[str], set[str]]:
    """Server warnings plus a local rank-disagreement pass, so an old server still gets highlights."""
    local = rank_disagreement(State(), timeline.runners, now, th)
    seen = {(w.code, w.instance_id, w.runner_id) for w in timeline.warnings}
    found = [*timeline.warnings, *(w for w in local if (w.code, w.instance_id, w.runner_id) not in seen)]
    stuck = {w.runner_id for w in found if w.code in STUCK_CODES and w.runner_id}
    disagreeing = {w.instance_id for w in found if w.code == "rank_disagreement" and w.instance_id}
    return found, stuck, disagreeing


def _style(runner: ClusterTimelineRunner, stuck: set[str], disagreeing: set[str], th: Thresholds) -> str:
    long_wait = runner.phase in BARRIER_PHASES and runner.seconds_in_phase > th.barrier_wait_s
    if runner.runner_id in stuck or (long_wait and runner.instance_id in disagreeing):
        return STUCK_STYLE
    return PEER_STYLE if runner.instance_id in disagreeing else ""


def _status(kind: str) -> str:
    return kind.removeprefix("Runner") or kind


def timeline_table(
    timeline: ClusterTimeline, stuck: set[str], disagreeing: set[str], th: Thresholds
) -> Table:
    table = Table(title=f"Skulk cluster timeline — {timeline.generated_at}", expand=False)
    for name, justify in (("node", "left"), ("model", "left"), ("rank", "right"), ("status", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("phase", no_wrap=True)
    table.add_column("in phase", justify="right")
    table.add_column("active task")
    for r in timeline.runners:
        style = _style(r, stuck, disagreeing, th)
        marker = " ⚠ STUCK" if style == STUCK_STYLE else ""
        table.add_row(
            r.node_id[:12],
            r.model_id,
            f"{r.device_rank}/{r.world_size}",
            _status(r.status_kind) + ("" if r.process_alive else " (dead)"),
            r.phase + marker,
            f"{r.seconds_in_phase:.1f}s",
            (r.active_task_id or "-")[:12],
            style=style,
        )
    return table


def render_timeline(
    timeline: ClusterTimeline, now: datetime | None = None, th: Thresholds = DEFAULT_THRESHOLDS
) -> RenderableType:
    found, stuck, disagreeing = _flags(timeline, now or utc_now(), th)
    parts: list[RenderableType] = [timeline_table(timeline, stuck, disagreeing, th)]
    if not timeline.runners:
        parts.append(Text("no runners reported", style="dim"))
    for node in timeline.unreachable_nodes:
        parts.append(Text(f"unreachable: {node}", style="bold red"))
    for w in found:
        style = {"critical": "bold red", "warning": "yellow"}.get(w.severity, "dim")
        parts.append(Text(f"{w.severity.upper()} {w.code}: {w.message}", style=style))
    return Group(*parts)


def meta_table(listing: dict[str, Any]) -> Table | None:
    """GET /meta_instances as a table: each MetaInstance, its backing instances and how it stands."""
    metas = listing.get("meta_instances") or {}
    if not metas:
        return None
    table = Table(title="MetaInstances", expand=False)
    for name in ("meta instance", "model", "sharding", "min nodes", "instances", "status"):
        table.add_column(name)
    for mid, meta in sorted(metas.items()):
        status = str(meta.get("status", ""))
        style = "red" if status.startswith(("error", "RETRYING")) else None
        instances = ", ".join(i[:8] for i in meta.get("instance_ids", [])) or "-"
        table.add_row(mid[:8], str(meta.get("modelId")), str(meta.get("sharding")), str(meta.get("minNodes")),
                      instances, status, style=style)
    return table


def fetch_meta_instances(url: str, timeout: float, verify: ssl.SSLContext | bool = True) -> dict[str, Any]:
    """Best effort: a node without MetaInstance support (or a failing one) shows no table, not an error."""
    try:
        response = httpx.get(url.rstrip("/") + "/meta_instances", timeout=timeout, trust_env=False, verify=verify)
        return response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _with_metas(view: RenderableType, url: str, timeout: float, verify: ssl.SSLContext | bool) -> RenderableType:
    table = meta_table(fetch_meta_instances(url, timeout, verify))
    return view if table is None else Group(view, table)


def fetch_timeline(url: str, timeout: float, verify: ssl.SSLContext | bool = True) -> ClusterTimeline:
    response = httpx.get(url.rstrip("/") + TIMELINE_PATH, timeout=timeout, trust_env=False, verify=verify)
    response.raise_for_status()
    return ClusterTimeline.model_validate(response.json())


def _frame(url: str, timeout: float, verify: ssl.SSLContext | bool) -> RenderableType:
    try:
        return _with_metas(render_timeline(fetch_timeline(url, timeout, verify)), url, timeout, verify)
    except (httpx.HTTPError, ValueError) as exc:
        return Text(f"cannot read {url}{TIMELINE_PATH}: {exc}", style="bold red")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="skulk diag", description="Show the cluster timeline: every runner's rank, phase and time in it."
    )
    parser.add_argument(
        "--url", default="http://localhost:52415", help="any node's API (default %(default)s; https:// for a "
        "node started with --tls-cert)"
    )
    parser.add_argument("--ca", default=os.environ.get("SKULK_TLS_CA"),
                        help="CA file an https node's certificate is verified against: the node's cert.pem for a "
                        "self-signed pair (SKULK_TLS_CA; default: the system's CAs)")
    parser.add_argument("--watch", action="store_true", help="redraw until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    parser.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds (default 10)")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> None:

    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console()
    verify = ssl.create_default_context(cafile=args.ca) if args.ca else True
    if not args.watch:
        try:
            timeline = fetch_timeline(args.url, args.timeout, verify)
        except (httpx.HTTPError, ValueError) as exc:
            console.print(f"[bold red]cannot read {args.url}{TIMELINE_PATH}: {exc}[/]")
            raise SystemExit(1) from exc
        console.print(_with_metas(render_timeline(timeline), args.url, args.timeout, verify))
        return
    try:
        with Live(_frame(args.url, args.timeout, verify), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(max(0.2, args.interval))
                live.update(_frame(args.url, args.timeout, verify), refresh=True)
    except KeyboardInterrupt:
        return
