"""Real rank processes over gloo on loopback: Pipeline over 2 and 3 ranks and Tensor over 2 give the single-rank
greedy tokens; a killed rank makes its peer fail fast; and the whole runner path (supervisors, runner_main) serves
a task across two ranks."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.wire import Released
from skulk.models.demo import demo_card, ensure_demo_model
from skulk.runner.group import connect_group
from skulk.runner.recorder import FlightRecorder
from skulk.runner.spec import RunnerSpec
from skulk.testing.nodes import free_port
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.chunks import ErrorChunk, TokenChunk
from skulk.types.ids import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from skulk.types.instances import Rendezvous, Sharding
from skulk.types.runners import RunnerFailed, RunnerReady, RunnerStatus
from skulk.types.shards import PipelineShardMetadata, TensorShardMetadata
from skulk.types.tasks import ChatCompletion, ChatCompletionTaskParams
from skulk.worker.supervisor import RunnerSupervisor, SupervisorCallbacks

GREEDY = SamplingParams(max_tokens=16, temperature=0)
PROMPTS = {"a": [258, *b"hello there", 259, 10], "b": [*b"abc def ghi jkl", 10, 258]}
PROMPTS["c"] = [*PROMPTS["a"], *b"and more"]  # starts from a's cached blocks on every rank
# each batch runs to completion before the next: a and b alone, then both concurrently, then c
BATCHES = [["a"], ["b"], ["a", "b"], ["c"]]
Layers = list[tuple[int, int]]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


CONTEXT = 40
"""The ranks' cache (rank_main): blocks of 4 positions and the smallest pool (11 blocks: one request of the whole
context), so a and b together (8 + 9 blocks) cannot both grow: one is preempted and resumed on every rank."""


@pytest.fixture(scope="module")
def single_rank(demo_dir: Path) -> dict[str, list[int]]:
    """Each prompt alone on a fresh engine whose cache is contiguous (one block of the whole context per request,
    the layout before paging): the cold truth that paging, shared prefixes and preemption must reproduce."""
    outs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        engine = TorchEngine(demo_dir, max_batch=8, max_seq=CONTEXT, block_size=CONTEXT)
        engine.add_request(rid, prompt, GREEDY)
        while engine.has_work():
            for tok in engine.step():
                outs[tok.request_id].append(tok.token_id)
    return outs


def make_spec(
    demo_dir: Path, rank: int, layers: Layers, sharding: Sharding, port: int, name: str = "r"
) -> RunnerSpec:
    start, end = layers[rank]
    shard_type = TensorShardMetadata if sharding == Sharding.Tensor else PipelineShardMetadata
    shard = shard_type(
        model_card=demo_card(), device_rank=rank, world_size=len(layers),
        start_layer=start, end_layer=end, n_layers=8,
    )
    return RunnerSpec(
        node_id=NodeId(f"node-{rank}"), runner_id=RunnerId(f"{name}{rank}"), instance_id=InstanceId("inst"),
        shard=shard, sharding=sharding, model_dir=demo_dir, rendezvous=Rendezvous(host="127.0.0.1", port=port),
        connect_deadline_s=30.0, warmup_deadline_s=60.0,
    )


def rank_main(spec: RunnerSpec, results: Any, hang_after_warmup: bool) -> None:
    """One rank: form the group, load, warm up, then rank 0 schedules the batches and the sampler reports."""
    torch.set_num_threads(1)
    group = connect_group(spec, FlightRecorder(spec.context(os.getpid()), enabled=False))
    engine = TorchEngine(
        spec.model_dir, rank=group.rank, world_size=group.world_size,
        kind="tensor" if spec.sharding == Sharding.Tensor else "pipeline",
        start_layer=spec.shard.start_layer, end_layer=spec.shard.end_layer, control_group=group.control,
        prefill_chunk=4,  # every prompt spans several chunks, interleaved with decodes in a batch
        max_seq=CONTEXT, block_size=4, kv_cache_bytes=0,
    )
    group.wait_all_loaded(60)
    engine.warmup()
    results.put(("ready", group.rank))
    if hang_after_warmup:  # idle forever: heartbeats only, until a peer dies
        while True:
            if engine.has_work():
                engine.step()
            time.sleep(0.05)
    outs: dict[str, list[int]] = {}
    if engine.is_scheduler:
        _schedule(engine)
        results.put(("preemptions", engine.preemptions))
    else:
        while not engine.closed:
            for tok in engine.step():
                outs.setdefault(tok.request_id, []).append(tok.token_id)
    if engine.is_sampler:
        results.put(("tokens", outs))
    group.destroy()


def _schedule(engine: TorchEngine) -> None:
    for number, batch in enumerate(BATCHES):
        open_ids = {f"{rid}{number}" for rid in batch}
        for rid in batch:
            engine.add_request(f"{rid}{number}", PROMPTS[rid], GREEDY, command_id=f"c-{rid}{number}")
        while open_ids:
            engine.step()
            open_ids -= {e.request_id for e in engine.take_events() if isinstance(e, Released)}
    engine.close()


def start_ranks(
    demo_dir: Path, layers: Layers, sharding: Sharding, *, hang: bool = False
) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(make_spec(demo_dir, r, layers, sharding, port), results, hang))
        for r in range(len(layers))
    ]
    for proc in procs:
        proc.start()
    return procs, results


def stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("layers", "sharding"),
    [
        ([(0, 4), (4, 8)], Sharding.Pipeline),
        ([(0, 3), (3, 6), (6, 8)], Sharding.Pipeline),
        ([(0, 8), (0, 8)], Sharding.Tensor),
    ],
    ids=["pipeline-2", "pipeline-3", "tensor-2"],
)
def test_greedy_output_equals_single_rank(
    demo_dir: Path, single_rank: dict[str, list[int]], layers: Layers, sharding: Sharding
) -> None:
    procs, results = start_ranks(demo_dir, layers, sharding)
    try:
        got: dict[str, Any] = {}
        while len(got) < 2:
            kind, value = results.get(timeout=120)
            if kind in ("tokens", "preemptions"):
                got[kind] = value
        tokens = got["tokens"]
        for proc in procs:
            proc.join(30)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        stop(procs)
    expected = {f"{rid}{n}": single_rank[rid] for n, batch in enumerate(BATCHES) for rid in batch}
    assert tokens == expected
    assert all(len(ids) == GREEDY.max_tokens for ids in tokens.values())
    assert got["preemptions"] >= 1  # a and b did not fit together: one was preempted, and resumed to these tokens


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_rank_fails_its_peer_fast(demo_dir: Path, victim: int) -> None:
    procs, results = start_ranks(demo_dir, [(0, 4), (4, 8)], Sharding.Pipeline, hang=True)
    try:
        ready = {results.get(timeout=90)[1] for _ in procs}
        assert ready == {0, 1}
        os.kill(procs[victim].pid, signal.SIGKILL)
        survivor = procs[1 - victim]
        killed_at = time.monotonic()
        survivor.join(15)
        assert not survivor.is_alive(), "the surviving rank hung after its peer died"
        assert survivor.exitcode not in (0, None)
        assert time.monotonic() - killed_at < 15
    finally:
        stop(procs)


# --- the real runner path: two supervisors, two runner_main processes -----------------------------------


class Collected:
    def __init__(self) -> None:
        self.statuses: dict[str, list[RunnerStatus]] = {}
        self.chunks: dict[str, list[TokenChunk | ErrorChunk]] = {}

    def callbacks(self, name: str) -> SupervisorCallbacks:
        self.statuses[name], self.chunks[name] = [], []
        return SupervisorCallbacks(
            on_status=self.statuses[name].append,
            on_chunks=self.chunks[name].extend,
            on_task_started=lambda _task_id: None,
            on_task_ended=lambda _ended: None,
        )


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def start_runners(demo_dir: Path, seen: Collected) -> list[RunnerSupervisor]:
    port = free_port()
    specs = [make_spec(demo_dir, r, [(0, 4), (4, 8)], Sharding.Pipeline, port, "runner") for r in range(2)]
    supervisors = [RunnerSupervisor(spec, seen.callbacks(spec.runner_id)) for spec in specs]
    for supervisor in supervisors:
        supervisor.start()
    for spec in specs:
        await wait_for(lambda s=spec: any(isinstance(x, RunnerReady) for x in seen.statuses[s.runner_id]),
                       120, f"{spec.runner_id} ready")
    return supervisors


@pytest.mark.timeout(180)
async def test_runner_path_serves_a_task_across_two_ranks(demo_dir: Path) -> None:
    messages = [ChatMessage(role="user", content="hello ranks")]
    reference = TorchEngine(demo_dir)
    reference.add_request("ref", reference.encode_chat(messages), GREEDY)
    expected: list[int] = []
    while reference.has_work():
        expected += [t.token_id for t in reference.step()]

    seen = Collected()
    supervisors: list[RunnerSupervisor] = []
    try:
        supervisors = await start_runners(demo_dir, seen)
        task = ChatCompletion(
            task_id=TaskId("task-1"), command_id=CommandId("cmd-1"), instance_id=InstanceId("inst"),
            model=ModelId("skulk/tiny-random-llama"),
            task_params=ChatCompletionTaskParams(model=ModelId("skulk/tiny-random-llama"), messages=messages,
                                                 sampling=GREEDY),
        )
        for supervisor in supervisors:
            supervisor.send_task(task)
        sampler = seen.chunks["runner1"]
        await wait_for(lambda: any(getattr(c, "finish_reason", None) for c in sampler), 60, "the last token")
        assert seen.chunks["runner0"] == [], "only the sampler publishes tokens"
        assert [c.token_id for c in sampler if isinstance(c, TokenChunk)] == expected
        last = sampler[-1]
        assert isinstance(last, TokenChunk) and last.stats is not None
        stats = last.stats.generation
        # issue 27: the sampler's prefill clock started after the prefill, reading 420,000-2,225,000 tok/s. A
        # prefill passes both ranks and the socket between them once, as each decode step does: it cannot take
        # less than a fraction of one decode step of the same request (it read 1/100 of one before the fix)
        assert stats.generation_tps > 0, "the demo model's greedy answer to this prompt is more than one token"
        prefill_s, step_s = stats.prompt_tokens / stats.prompt_tps, 1 / stats.generation_tps
        assert prefill_s >= step_s / 5, (prefill_s, step_s, stats.prompt_tps)
        await wait_for(lambda: all(not s.view.in_progress for s in supervisors), 10, "tasks to end everywhere")
    finally:
        await asyncio.gather(*(s.stop() for s in supervisors))
    assert [s.view.exit_code for s in supervisors] == [0, 0]
    assert not any(isinstance(x, RunnerFailed) for xs in seen.statuses.values() for x in xs)


@pytest.mark.timeout(120)
async def test_runner_losing_its_peer_fails_fast(demo_dir: Path) -> None:
    seen = Collected()
    supervisors: list[RunnerSupervisor] = []
    try:
        supervisors = await start_runners(demo_dir, seen)
        pid = supervisors[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: any(isinstance(x, RunnerFailed) for x in seen.statuses["runner0"]), 15,
                       "rank 0 to fail after its peer was killed")
        assert supervisors[0].view.exit_code not in (0, None)
    finally:
        await asyncio.gather(*(s.stop() for s in supervisors))
