"""The tensor plane takes no code from the network: a peer in the group (here a forged rank 0 over real gloo
sockets) that sends a pickle as a step header gets its header refused, and the pickle never runs, whether the
header is broadcast (a Tensor group) or posted point to point (a Pipeline, wire.PostedHeaders)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from skulk.testing.nodes import free_port

pytestmark = pytest.mark.timeout(60)


class _Exploit:
    """What an attacker sends: unpickling it runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _group(rank: int, port: int) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=20)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=5))
    return dist


def _channel(dist: Any, rank: int, posted: bool) -> Any:
    from skulk.engines.torch.wire import HeaderChannel, PostedHeaders

    return PostedHeaders(dist.group.WORLD, rank, 2) if posted else HeaderChannel(dist.group.WORLD)


def _attacker(port: int, marker: Path, posted: bool) -> None:
    """Rank 0 played by an attacker: one honest header, then the fixed header announcing a pickle, then the pickle."""
    import torch

    from skulk.engines.torch.wire import ALL_ROWS, FIXED_INTS, HEADER_TAG, PAYLOAD_TAG, Header, NewRequest, StepKind
    from skulk.types.chat import SamplingParams

    dist = _group(0, port)
    channel = _channel(dist, 0, posted)
    channel.send(Header(StepKind.PREFILL, (NewRequest.of("r1", "c1", [1, 2, 3], SamplingParams(max_tokens=4)),)))
    if posted:
        channel.flush()
    payload = pickle.dumps(_Exploit(marker))
    fixed = torch.zeros(FIXED_INTS, dtype=torch.int64)
    fixed[:2] = torch.tensor([int(StepKind.PREFILL), len(payload)])
    fixed[-1] = ALL_ROWS
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    try:
        if posted:
            dist.send(fixed, 1, tag=HEADER_TAG)
            dist.send(data, 1, tag=PAYLOAD_TAG)
        else:
            dist.broadcast(fixed, src=0)
            dist.broadcast(data, src=0)
    except RuntimeError:
        pass  # the victim may leave the group as soon as it refuses the header


def _victim(port: int, results: Any, posted: bool) -> None:
    from skulk.engines.torch.wire import WireError

    dist = _group(1, port)
    channel = _channel(dist, 1, posted)
    honest = channel.receive()
    add = honest.adds[0]
    results.put(("honest", add.request_id, add.prompt, add.sampling_params().max_tokens))
    try:
        channel.receive()
        results.put(("accepted",))
    except WireError as exc:
        results.put(("refused", str(exc)))


@pytest.mark.parametrize("posted", [False, True], ids=["broadcast", "posted"])
def test_a_pickled_step_header_is_refused_without_running(tmp_path: Path, posted: bool) -> None:
    marker = tmp_path / "pwned"
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_attacker, args=(port, marker, posted)),
             ctx.Process(target=_victim, args=(port, results, posted))]
    for p in procs:
        p.start()
    try:
        assert results.get(timeout=45) == ("honest", "r1", [1, 2, 3], 4)
        verdict = results.get(timeout=30)
        assert verdict[0] == "refused", verdict
        assert "malformed step header" in verdict[1]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not marker.exists(), "the attacker's pickle ran inside the victim rank"


def test_a_header_out_of_bounds_is_refused_before_anything_is_allocated() -> None:
    from skulk.engines.torch.wire import MAX_ADMITS, MAX_CHANGES_BYTES, StepKind, WireError, decode_fixed

    assert decode_fixed(int(StepKind.MIXED), 10, MAX_ADMITS) == (StepKind.MIXED, 10)
    for kind, size, admits, why in [(9, 0, 0, "unknown step kind"), (1, MAX_CHANGES_BYTES + 1, 0, "out of bounds"),
                                    (1, 0, MAX_ADMITS + 1, "admits"), (1, 0, -1, "admits")]:
        with pytest.raises(WireError, match=why):
            decode_fixed(kind, size, admits)
