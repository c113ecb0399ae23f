"""`skulk diag` rendering: the stuck rank's row is marked and red, its peers yellow."""

from __future__ import annotations

import socket

import pytest
from rich.console import Console

from skulk.diagnostics.cli import main, render_timeline
from skulk.types.diagnostics_bundle import ClusterTimeline

from .diagnostics_fakes import NOW, timeline_runner


def _render(timeline: ClusterTimeline, styles: bool = False) -> str:
    console = Console(record=True, width=160, force_terminal=True, color_system="standard")
    console.print(render_timeline(timeline, NOW))
    return console.export_text(styles=styles)


def _stuck_timeline() -> ClusterTimeline:
    return ClusterTimeline(
        generated_at=NOW.isoformat(),
        runners=[
            timeline_runner("n1", 0, "decode_stream", 42.0),
            timeline_runner("n2", 1, "decode_barrier", 41.5),
        ],
        unreachable_nodes=["n3"],
    )


def test_stuck_rank_is_marked_and_highlighted() -> None:
    text = _render(_stuck_timeline())
    lines = text.splitlines()
    stuck = next(line for line in lines if "decode_barrier" in line)
    peer = next(line for line in lines if "decode_stream" in line)
    assert "STUCK" in stuck and "1/2" in stuck and "41.5s" in stuck and "n2" in stuck
    assert "STUCK" not in peer and "0/2" in peer
    assert "unreachable: n3" in text
    assert "rank_disagreement" in text
    styled = _render(_stuck_timeline(), styles=True).splitlines()
    assert "\x1b[1;31m" in next(line for line in styled if "decode_barrier" in line)
    assert "\x1b[33m" in next(line for line in styled if "decode_stream" in line)


def test_healthy_cluster_has_no_highlight() -> None:
    timeline = ClusterTimeline(
        generated_at=NOW.isoformat(),
        runners=[
            timeline_runner("n1", 0, "decode_stream", 1.0),
            timeline_runner("n2", 1, "decode_stream", 1),
        ],
    )
    text = _render(timeline, styles=True)
    assert "STUCK" not in text and "\x1b[1;31m" not in text
    for column in ("node", "model", "rank", "status", "phase", "in phase", "active task"):
        assert column in text


def test_unreachable_api_exits_nonzero() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SystemExit) as exited:
        main(["--url", f"http://127.0.0.1:{port}", "--timeout", "1"])
    assert exited.value.code == 1
