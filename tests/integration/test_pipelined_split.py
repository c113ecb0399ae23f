"""Pipelined micro-batches (issue 28): rank 0 leads a step for one group of streams while later ranks compute
another, and the tokens are the unpipelined schedule's, token for token (greedy), over real rank processes on
gloo: 2 and 3 ranks, with requests joining and finishing mid-flight and a cancel, micro-batches always on and as
the decision rule switches them on and off between steps. A rank killed mid-pipeline (either
of 2, or the middle one of 3) ends every open stream with a retryable error through the real runner path
(supervisors, runner_main)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.pace import Pace
from skulk.engines.torch.wire import Released
from skulk.models.demo import ensure_demo_model
from skulk.runner.group import connect_group
from skulk.runner.recorder import FlightRecorder
from skulk.runner.spec import RunnerSpec
from skulk.testing.nodes import free_port
from skulk.types.chat import ChatMessage, SamplingParams
from skulk.types.chunks import ErrorChunk, TokenChunk
from skulk.types.ids import CommandId, InstanceId, ModelId, TaskId
from skulk.types.instances import Sharding
from skulk.types.runners import RunnerFailed
from skulk.types.tasks import ChatCompletion, ChatCompletionTaskParams
from skulk.worker.supervisor import RunnerSupervisor

from .test_distributed_engine import Collected, make_spec, wait_for

pytestmark = pytest.mark.integration

PROMPTS = {
    "a": [258, *b"hello there", 259, 10],
    "b": [*b"abc def ghi jkl", 10, 258],
    "c": [*b"the quick brown fox", 10],
    "d": [*b"one two", 10],
    "e": [*b"joins later, mid-flight", 10],
    "f": [*b"and one more", 10],
}
MAX_TOKENS = {"a": 6, "b": 14, "c": 14, "d": 10, "e": 12, "f": 9}
JOIN = {"e": ("a", 2), "f": ("b", 5)}  # added once rank 0 has seen that many tokens of that request (mid-flight)
CANCEL = ("c", 3)  # cancelled once rank 0 has seen this many of its tokens, with others in flight
Layers = list[tuple[int, int]]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


class SwitchingPace(Pace):
    """A pace that makes micro_batching's rule switch as the decoding rows change (2 or 5 rows over 2 ranks:
    micro-batches; 3, 4 or 6: the plain schedule), so the rule's schedule changes mid-flight, deterministically."""

    def shares(self, rows: int) -> list[float]:
        return [float(rows % 3 + 1)] * self.world_size

    def hops(self, rows: int) -> float:
        return 0.0


def rank_main(spec: RunnerSpec, micro_batches: bool | None, results: Any) -> None:
    """One rank; rank 0 plays the script (step counts, not time), the sampler reports every token it sampled."""
    torch.set_num_threads(1)
    group = connect_group(spec, FlightRecorder(spec.context(os.getpid()), enabled=False))
    engine = TorchEngine(
        spec.model_dir, rank=group.rank, world_size=group.world_size, kind="pipeline",
        start_layer=spec.shard.start_layer, end_layer=spec.shard.end_layer, control_group=group.control,
        prefill_chunk=4, max_seq=64, block_size=4,
    )
    engine.micro_batches = micro_batches
    if micro_batches is None:
        engine.pace = SwitchingPace(group.world_size, 1, group.world_size)
    group.wait_all_loaded(60)
    engine.warmup()
    outs: dict[str, list[int]] = {}
    if engine.is_scheduler:
        results.put(("script", _play(engine)))
    else:
        while not engine.closed:
            for tok in engine.step():
                outs.setdefault(tok.request_id, []).append(tok.token_id)
    if engine.is_sampler:
        results.put(("tokens", outs))
    group.destroy()


def _play(engine: TorchEngine) -> dict[str, Any]:
    greedy = {rid: SamplingParams(max_tokens=n, temperature=0) for rid, n in MAX_TOKENS.items()}
    for rid in "abcd":
        engine.add_request(rid, PROMPTS[rid], greedy[rid])
    released: dict[str, bool] = {}
    added, cancelled, micros = set("abcd"), False, set()
    while len(released) < len(PROMPTS):
        engine.step()
        micros.add(engine.micro)
        seen = {r.request_id: len(r.emitted) for r in engine._running}  # rank 0's view: tokens back so far
        for rid, (after, count) in JOIN.items():
            if rid not in added and seen.get(after, 0) >= count:
                engine.add_request(rid, PROMPTS[rid], greedy[rid])
                added.add(rid)
        if not cancelled and seen.get(CANCEL[0], 0) >= CANCEL[1]:
            engine.cancel(CANCEL[0])
            cancelled = True
        released |= {e.request_id: e.cancelled for e in engine.take_events() if isinstance(e, Released)}
    engine.close()
    return {"released": released, "overlapped": engine.overlapped, "micros": micros}


def run(demo_dir: Path, layers: Layers, micro_batches: bool | None
        ) -> tuple[dict[str, list[int]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(make_spec(demo_dir, r, layers, Sharding.Pipeline, port),
                                                 micro_batches, results)) for r in range(len(layers))]
    for proc in procs:
        proc.start()
    try:
        got: dict[str, Any] = {}
        while len(got) < 2:
            kind, value = results.get(timeout=150)
            got[kind] = value
        for proc in procs:
            proc.join(30)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
    return got["tokens"], got["script"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layers", [[(0, 4), (4, 8)], [(0, 3), (3, 6), (6, 8)]], ids=["pipeline-2", "pipeline-3"])
def test_pipelined_schedule_equals_the_plain_one(demo_dir: Path, layers: Layers) -> None:
    plain, plain_script = run(demo_dir, layers, micro_batches=False)
    assert plain_script["overlapped"] == 0
    # 2 ranks: as the decision rule decides (SwitchingPace turns micro-batches off and on); 3: always
    mode = None if len(layers) == 2 else True
    piped, piped_script = run(demo_dir, layers, micro_batches=mode)
    assert piped_script["overlapped"] > 0, "rank 0 never led a step while another was in flight"
    if mode is None:
        assert piped_script["micros"] == {1, 2}, "the rule never switched the micro-batches off and on"
    cancelled, _ = CANCEL
    for script in (plain_script, piped_script):
        assert script["released"] == {rid: rid == cancelled for rid in PROMPTS}
    for rid in PROMPTS:
        if rid == cancelled:  # cut at a different token in each schedule: the same tokens up to the cut
            shorter, longer = sorted((plain[rid], piped[rid]), key=len)
            assert longer[: len(shorter)] == shorter and len(longer) < MAX_TOKENS[rid]
            continue
        assert piped[rid] == plain[rid], rid
        assert len(piped[rid]) == MAX_TOKENS[rid] or piped[rid][-1] in (0, 1, 2), rid


# --- a rank lost mid-pipeline, through the real runner path -----------------------------------------------------

STREAMS = 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("layers", "victim"), [([(0, 4), (4, 8)], 0), ([(0, 4), (4, 8)], 1),
                                                ([(0, 3), (3, 6), (6, 8)], 1)],
                         ids=["2-ranks-kill-0", "2-ranks-kill-1", "3-ranks-kill-middle"])
async def test_a_rank_lost_mid_pipeline_ends_every_stream_retryably(demo_dir: Path, layers: Layers,
                                                                     victim: int) -> None:
    seen = Collected()
    port = free_port()
    specs = [make_spec(demo_dir, r, layers, Sharding.Pipeline, port, "runner") for r in range(len(layers))]
    supervisors = [RunnerSupervisor(spec, seen.callbacks(spec.runner_id)) for spec in specs]
    model = ModelId("skulk/tiny-random-llama")
    long = SamplingParams(max_tokens=4000, temperature=0)
    tasks = [ChatCompletion(task_id=TaskId(f"t{i}"), command_id=CommandId(f"c{i}"), instance_id=InstanceId("inst"),
                            model=model, task_params=ChatCompletionTaskParams(
                                model=model, messages=[ChatMessage(role="user", content=f"stream {i}")],
                                sampling=long))
             for i in range(STREAMS)]
    try:
        for supervisor in supervisors:
            supervisor.start()
        for spec in specs:
            await wait_for(lambda s=spec: any(type(x).__name__ == "RunnerReady" for x in seen.statuses[s.runner_id]),
                           120, f"{spec.runner_id} ready")
        for task in tasks:
            for supervisor in supervisors:
                supervisor.send_task(task)
        sampled = seen.chunks[f"runner{len(layers) - 1}"]

        def streaming() -> bool:
            counts = {c.command_id: 0 for c in sampled}
            for c in sampled:
                counts[c.command_id] += 1
            return len(counts) == STREAMS and min(counts.values()) >= 3

        await wait_for(streaming, 60, "every stream well into decode")
        pid = supervisors[victim].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for survivor in (f"runner{r}" for r in range(len(layers)) if r != victim):
            await wait_for(lambda s=survivor: any(isinstance(x, RunnerFailed) for x in seen.statuses[s]), 20,
                           f"the surviving rank {survivor} to fail")

        def errors() -> dict[str, ErrorChunk]:
            return {c.command_id: c for chunks in seen.chunks.values() for c in chunks if isinstance(c, ErrorChunk)}

        await wait_for(lambda: len(errors()) == STREAMS, 20, "an error on every stream")
        assert all(e.retryable for e in errors().values()), errors()
        assert not any(isinstance(c, TokenChunk) and c.finish_reason for c in sampled), "a stream ended normally"
    finally:
        await asyncio.gather(*(s.stop() for s in supervisors))
