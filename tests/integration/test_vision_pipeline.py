"""Images on a Pipeline over 2 ranks (real rank processes over gloo on loopback): rank 0 runs the vision tower and
embeds, rank 1 gets hidden states; two image requests at once, in small prefill chunks riding on each other's
decode steps, give each one's single-rank greedy tokens. For Gemma 3 and for Qwen2.5-VL, whose rank 1 rotates the
image's keys by its grid (multimodal rope: the grids travel in the step header) and every later position by index
plus the image's delta, as rank 0 does."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
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
from skulk.types.chat import SamplingParams
from skulk.types.ids import InstanceId, NodeId, RunnerId
from skulk.types.instances import Rendezvous, Sharding
from skulk.types.shards import PipelineShardMetadata
from tests.unit import qwen_vl_checkpoint
from tests.unit.test_vision import GREEDY, image_message
from tests.unit.vlm_checkpoint import png, write_gemma3_vlm

LAYERS = [(0, 2), (2, 4)]
PICTURES = {"a": 1, "b": 2}
FAMILIES: dict[str, tuple[Callable[[Path, Path], Path], Callable[[int], bytes], SamplingParams]] = {
    "gemma3": (write_gemma3_vlm, png, GREEDY),
    "qwen2_5_vl": (qwen_vl_checkpoint.write_qwen25_vl, qwen_vl_checkpoint.picture,
                   SamplingParams(max_tokens=qwen_vl_checkpoint.TOKENS, temperature=0)),
}
"""Per family: its checkpoint's writer, its pictures (a Qwen picture is not square: its rows and columns differ) and
its greedy sampling."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return request.param, FAMILIES[request.param][0](root, ensure_demo_model(root / "models"))


def alone(family: str, path: Path, rid: str) -> list[int]:
    engine = TorchEngine(path, max_batch=2, block_size=4, prefill_chunk=64)
    prompt, vision = engine.encode_images([image_message(FAMILIES[family][1](PICTURES[rid]))])
    engine.add_request(rid, prompt, FAMILIES[family][2], vision=vision)
    out: list[int] = []
    while engine.has_work():
        out += [t.token_id for t in engine.step()]
    return out


def spec(path: Path, rank: int, port: int) -> RunnerSpec:
    start, end = LAYERS[rank]
    card = demo_card().model_copy(update={"n_layers": 4})
    shard = PipelineShardMetadata(model_card=card, device_rank=rank, world_size=2, start_layer=start, end_layer=end,
                                  n_layers=4)
    return RunnerSpec(node_id=NodeId(f"node-{rank}"), runner_id=RunnerId(f"v{rank}"), instance_id=InstanceId("v"),
                      shard=shard, sharding=Sharding.Pipeline, model_dir=path,
                      rendezvous=Rendezvous(host="127.0.0.1", port=port), connect_deadline_s=30.0,
                      warmup_deadline_s=60.0)


def rank_main(spec: RunnerSpec, family: str, results: Any) -> None:
    torch.set_num_threads(1)
    group = connect_group(spec, FlightRecorder(spec.context(os.getpid()), enabled=False))
    engine = TorchEngine(spec.model_dir, rank=group.rank, world_size=2, kind="pipeline",
                         start_layer=spec.shard.start_layer, end_layer=spec.shard.end_layer,
                         control_group=group.control, prefill_chunk=6, block_size=4, max_batch=2)
    group.wait_all_loaded(60)
    engine.warmup()
    outs: dict[str, list[int]] = {}
    if engine.is_scheduler:
        for rid, seed in PICTURES.items():
            prompt, vision = engine.encode_images([image_message(FAMILIES[family][1](seed))])
            engine.add_request(rid, prompt, FAMILIES[family][2], vision=vision)
        open_ids = set(PICTURES)
        while open_ids:
            engine.step()
            open_ids -= {e.request_id for e in engine.take_events() if isinstance(e, Released)}
        engine.close()
    else:
        while not engine.closed:
            for tok in engine.step():
                outs.setdefault(tok.request_id, []).append(tok.token_id)
        results.put(outs)
    group.destroy()


@pytest.mark.timeout(240)
def test_pipeline_over_two_ranks_gives_the_single_rank_tokens(vlm: tuple[str, Path]) -> None:
    family, path = vlm
    expected = {rid: alone(family, path, rid) for rid in PICTURES}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(spec(path, r, port), family, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = results.get(timeout=180)
        for proc in procs:
            proc.join(30)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
    assert got == expected
    assert expected["a"] != expected["b"]
