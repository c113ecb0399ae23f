"""The tensor plane takes no code from the network: a peer in the group (here a forged rank 0 over real gloo
sockets) that sends a pickle as a step header gets its header refused, and the pickle never runs."""

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


def _attacker(port: int, marker: Path) -> None:
    """Rank 0 played by an attacker: one honest header, then the fixed header announcing a pickle, then the pickle."""
    import torch

    from skulk.engines.torch.wire import FIXED_INTS, Header, HeaderChannel, NewRequest, StepKind
    from skulk.types.chat import SamplingParams

    dist = _group(0, port)
    HeaderChannel(dist.group.WORLD).send(
        Header(StepKind.PREFILL, (NewRequest.of("r1", "c1", [1, 2, 3], SamplingParams(max_tokens=4)),))
    )
    payload = pickle.dumps(_Exploit(marker))
    fixed = torch.zeros(FIXED_INTS, dtype=torch.int64)
    fixed[:2] = torch.tensor([int(StepKind.PREFILL), len(payload)])
    try:
        dist.broadcast(fixed, src=0)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)
    except RuntimeError:
        pass  # the victim may leave the group as soon as it refuses the header


def _victim(port: int, results: Any) -> None:
    from skulk.engines.torch.wire import HeaderChannel, WireError

    dist = _group(1, port)
    channel = HeaderChannel(dist.group.WORLD)
    honest = channel.receive()
    add = honest.adds[0]
    results.put(("honest", add.request_id, add.prompt, add.sampling_params().max_tokens))
    try:
        channel.receive()
        results.put(("accepted",))
    except WireError as exc:
        results.put(("refused", str(exc)))


def test_a_pickled_step_header_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_attacker, args=(port, marker)), ctx.Process(target=_victim, args=(port, results))]
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
