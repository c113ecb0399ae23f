"""The data plane's CPU per token when the sampling rank and the API node are different nodes (issue 43): a step's
chunks as ONE message on `batches/<api node>` (cluster/dataplane.publish_step) against one put per chunk, side by
side in one run.

Two zenoh sessions in this process, as two nodes: the API node's `Requests` (its chunk and batch subscriptions,
--streams open requests) and a worker's node delivering engine steps of one chunk per stream
(`Requests.deliver_step`, what the runner's supervisor hands the worker). Each step is read off every stream before
the next is sent, as an API node keeping up would. The process's CPU time over --steps steps, per token: the
sender's put(s), zenoh both ways, the receiver's opening, validation and queueing, all in one figure. The two paths
alternate over --rounds (the order swapping), medians printed, and their ratio.

Measured 2026-12-07 22:46 UTC on the 2-core VM with other sessions' tests beside it (load average 10-11), 16 streams
x 400 steps, 4 rounds:
  one by one  0.111 ms CPU a token (rounds 0.111 0.126 0.112 0.109)
  batched     0.046 ms CPU a token (rounds 0.053 0.055 0.035 0.040)   batched ÷ one by one 0.42
Run: .venv/bin/python bench/dataplane.py [--streams 16] [--steps 400] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from skulk.api.requests import Requests
from skulk.cluster.dataplane import batch_key
from skulk.cluster.payloads import PayloadBook
from skulk.cluster.transport import Transport, TransportSettings
from skulk.testing.nodes import free_port
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.chunks import TokenChunk
from skulk.types.ids import CommandId, ModelId, NodeId
from skulk.types.tasks import ChatCompletionTaskParams

API, WORKER = NodeId("n1"), NodeId("n2")


def _pair() -> tuple[Transport, Transport]:
    cluster, port = f"dpbench{uuid.uuid4().hex[:6]}", free_port()
    api = Transport(TransportSettings(cluster=cluster, listen=[f"tcp/127.0.0.1:{port}"], multicast=False))
    api.open()
    worker = Transport(TransportSettings(cluster=cluster, listen=["tcp/127.0.0.1:0"], multicast=False,
                                         bootstrap_peers=[f"tcp/127.0.0.1:{port}"]))
    worker.open()
    return api, worker


async def cpu_ms_per_token(batched: bool, streams: int, steps: int) -> float:
    """CPU ms a token of `steps` steps of `streams` chunks from the worker's node to the API node."""
    api_transport, worker_transport = _pair()
    try:
        api = Requests(api_transport, PayloadBook(api_transport, API), lambda _: None)
        api.start()
        params = ChatCompletionTaskParams(model=ModelId("m"), messages=[ChatMessage(role="user", content="hi")],
                                          sampling=SamplingParams())
        ids = [CommandId(f"k{i}") for i in range(streams)]
        opened = [api.open(c, params) for c in ids]
        worker = Requests(worker_transport, PayloadBook(worker_transport, WORKER), lambda _: None)
        async with asyncio.timeout(10):
            while not worker_transport.matched(batch_key(API)):
                await asyncio.sleep(0.01)
        if not batched:  # the API node as one of an earlier release looks to the sender: chunk by chunk
            worker_transport.matched = lambda _suffix: False  # type: ignore[method-assign]
        origins = {c: API for c in ids}
        start = time.process_time()
        for step in range(steps):
            worker.deliver_step([TokenChunk(command_id=c, text="ab", token_id=step, completion_tokens=step + 1)
                                 for c in ids], origins)
            for stream in opened:
                await stream.next(10)
        return 1000 * (time.process_time() - start) / (steps * streams)
    finally:
        worker_transport.close()
        api_transport.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    found: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds):
        for batched in ((True, False) if round_ % 2 == 0 else (False, True)):
            found[batched].append(await cpu_ms_per_token(batched, args.streams, args.steps))
    medians = {mode: statistics.median(values) for mode, values in found.items()}
    for mode, label in ((False, "one by one"), (True, "batched")):
        rounds = " ".join(f"{v:.3f}" for v in found[mode])
        print(f"{label:<11} {medians[mode]:.3f} ms CPU a token (rounds {rounds})")
    print(f"batched ÷ one by one {medians[True] / medians[False]:.2f}  ({args.streams} streams x {args.steps} steps)")


if __name__ == "__main__":
    asyncio.run(main())
