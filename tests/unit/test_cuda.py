"""The torch engine's CUDA support, the parts that hold without a GPU (issue 45): the device a rank computes on
(auto, the override, a bad or absent device refused with a message), the C kernels kept to the CPU, a node's GPU
memory reported and counted by placement, int8 on torch's CUDA layout (its dequantizing fallback runs anywhere),
and hidden states and all-reduces crossing a real gloo group through the host-memory copies. What needs a GPU is
in test_cuda_gpu.py (skipped here, with the reason)."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from skulk.config import ConfigError, resolve
from skulk.engines.torch import cpu_kernels, cuda_quant, links
from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.device import (
    DEVICE_ENV,
    DeviceUnavailable,
    available_bytes,
    describe,
    device_memory,
    engine_device,
    resolve_device,
    to_device,
    to_host,
    uses_c_kernels,
)
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.quant import affine_quantize, dequantize, pack_mlx, unpack_mlx
from skulk.master.memory_pool import gpu_free_bytes, usable_bytes
from skulk.master.placement import place
from skulk.models.demo import ensure_demo_model
from skulk.testing.nodes import free_port
from skulk.testing.random_llama import write_random_llama
from skulk.types.backends import cuda_advertised
from skulk.types.chat import SamplingParams
from skulk.types.ids import InstanceId, NodeId, RunnerId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import Memory
from skulk.types.node_info import AcceleratorInfo, MemoryUsage, Topology
from skulk.types.state import State
from skulk.worker import node_info

from .factories import CARD

pytestmark = pytest.mark.timeout(120)
GIB = 1 << 30
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer; this machine has a GPU")


# --- choosing the device -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("setting", "gpus", "expected"), [
    (None, 0, "cpu"), ("", 0, "cpu"), ("auto", 0, "cpu"), (None, 1, "cuda:0"), ("AUTO", 2, "cuda:0"),
    ("cpu", 1, "cpu"), (" CPU ", 0, "cpu"), ("cuda", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"),
])
def test_the_device_follows_the_setting_and_what_torch_sees(setting: str | None, gpus: int, expected: str) -> None:
    assert resolve_device(setting, gpus) == torch.device(expected)


@pytest.mark.parametrize(("setting", "gpus", "words"), [
    ("cuda", 0, "no CUDA device"), ("cuda:1", 1, "sees 1 CUDA device"), ("gpu", 1, "expected auto, cpu, cuda"),
    ("cuda:x", 1, "expected auto, cpu, cuda"), ("mps", 0, "expected auto, cpu, cuda"),
])
def test_a_device_that_is_not_there_is_refused_by_name(setting: str, gpus: int, words: str) -> None:
    with pytest.raises(DeviceUnavailable, match=words) as caught:
        resolve_device(setting, gpus)
    assert DEVICE_ENV in str(caught.value) and repr(setting) in str(caught.value)


@NO_GPU
def test_the_runner_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert engine_device() == torch.device("cpu")  # auto, no GPU here
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert engine_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        engine_device()  # forced onto a GPU that is not there: an error, never a silent CPU run
    assert engine_device("cpu") == torch.device("cpu")  # an explicit setting beats the environment


def test_the_node_setting_is_validated_and_normalised(tmp_path: Path) -> None:
    config = tmp_path / "skulk.yaml"
    config.write_text("torch_device: CUDA:0\n")
    assert resolve({"config": str(config), "home": str(tmp_path)}, {}).torch_device == "cuda:0"
    assert resolve({"config": str(config), "home": str(tmp_path)}, {DEVICE_ENV: "cpu"}).torch_device == "cpu"
    assert resolve({"config": str(tmp_path / "none.yaml"), "home": str(tmp_path)}, {}).torch_device is None
    with pytest.raises(ConfigError, match="auto, cpu, cuda or cuda:N"):
        resolve({"config": str(tmp_path / "none.yaml"), "home": str(tmp_path)}, {DEVICE_ENV: "gpu0"})


def test_the_node_hands_its_device_setting_to_its_runners(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Runners inherit the node's environment: a device set in skulk.yaml reaches them as SKULK_TORCH_DEVICE (and
    node_info.backends, which reads it too); none set leaves the environment alone."""
    from skulk.node import _runner_environment

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    none = tmp_path / "none.yaml"
    _runner_environment(resolve({"config": str(none), "home": str(tmp_path)}, {}))
    assert DEVICE_ENV not in os.environ
    config = tmp_path / "skulk.yaml"
    config.write_text("torch_device: cpu\n")
    _runner_environment(resolve({"config": str(config), "home": str(tmp_path)}, {}))
    assert os.environ[DEVICE_ENV] == "cpu"


# --- the C kernels stay on the CPU -------------------------------------------------------------------------------
def test_the_c_kernels_are_chosen_for_the_cpu_only() -> None:
    assert uses_c_kernels(torch.device("cpu"))
    for other in ("cuda", "cuda:1", "meta", "mps"):
        assert not uses_c_kernels(torch.device(other))
    assert cpu_kernels.handles(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_kernels.handles(torch.zeros(2, dtype=torch.bfloat16, device="meta"))


@pytest.mark.slow
def test_the_layer_stack_is_not_built_for_activations_off_the_cpu(tmp_path: Path) -> None:
    """The model's choice between the C layer stack and torch's op-by-op layers asks the activations' device: CPU
    activations get the stack (where the kernels load), any other device gets None, so a CUDA rank runs torch."""
    if not cpu_kernels.available():
        pytest.skip("the C kernels do not load here")
    model = load_model(ensure_demo_model(tmp_path))
    batch = StepBatch.build(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), kv_len=1)
    hidden = model.args.hidden_size
    assert model._layer_stack(torch.zeros(1, 1, hidden, dtype=model.args.dtype), batch, model.make_cache(2, 4))
    off = torch.zeros(1, 1, hidden, dtype=model.args.dtype, device="meta")
    assert model._layer_stack(off, batch, model.make_cache(2, 4)) is None


SMALL_LLAMA = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "intermediate_size": 1024, "head_dim": 32}


def _greedy(engine: TorchEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=32, temperature=0))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for token in engine.step():
            out[token.request_id].append(token.token_id)
    return out


@pytest.mark.slow
def test_the_op_by_op_path_a_cuda_rank_runs_gives_the_c_kernels_tokens(tmp_path: Path) -> None:
    """What a CUDA rank computes is torch's op-by-op path (every layer, paged attention as a gather then SDPA):
    on the CPU, with the kernels switched off, it gives the kernels' 32 greedy tokens (f32: no rounding apart)."""
    if not cpu_kernels.available():
        pytest.skip("the C kernels do not load here")
    path = write_random_llama(tmp_path / "llama", SMALL_LLAMA, ensure_demo_model(tmp_path / "demo"), std=0.2)
    prompts = [[258, *b"The quick brown fox jumps", 10], [*b"abc def ghi jkl mno", 10, 258]]
    sized: dict[str, Any] = {"max_seq": 128, "max_batch": 2, "kv_cache_bytes": 8 << 20, "dtype": "float32"}
    kernels = _greedy(TorchEngine(path, **sized), prompts)
    cpu_kernels.set_enabled(False)
    try:
        engine = TorchEngine(path, **sized)
        assert engine.model._layer_stack(torch.zeros(1, 1, 256), StepBatch.build(
            torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), kv_len=1), engine.cache) is None
        op_by_op = _greedy(engine, prompts)
    finally:
        cpu_kernels.set_enabled(True)
    assert all(len(t) == 32 for t in kernels.values())
    assert op_by_op == kernels


# --- host-memory copies ------------------------------------------------------------------------------------------
def test_the_copies_are_no_ops_on_the_cpu_and_move_otherwise() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    assert to_host(x) is x
    assert to_device(x, torch.device("cpu")) is x
    moved = to_device(x, torch.device("meta"))  # a device that is not the CPU, present on every machine
    assert moved.device.type == "meta" and moved.shape == x.shape and moved.dtype == x.dtype


def _group_rank(rank: int, port: int, results: Any) -> None:
    """One process of a 2-rank gloo group: rank 0 sends hidden states through GroupLink, rank 1 receives them; both
    all-reduce. The copy helpers are counted, so the test sees the wire path take them on a real group."""
    calls = {"to_host": 0, "to_device": 0}

    def counted(name: str, real: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            calls[name] += 1
            return real(*args)
        return wrapper

    links.to_host = counted("to_host", links.to_host)  # type: ignore[assignment]
    links.to_device = counted("to_device", links.to_device)  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        link = links.GroupLink(rank, 2, "pipeline", dist.group.WORLD)
        hidden = torch.arange(24, dtype=torch.bfloat16).view(1, 3, 8)
        if rank == 0:
            link.send_hidden(hidden * 2)
            link.flush()
            got = None
        else:
            got = link.recv_hidden((1, 3, 8), torch.bfloat16, torch.device("cpu"))
        summed = links.tensor_all_reduce(2)(torch.full((4,), float(rank + 1)))
        # plain lists, not tensors: torch sends a tensor through a queue as a shared-memory handle that the
        # receiver opens from this process, which may have exited by then (FileNotFoundError on a loaded host)
        results.put((rank, None if got is None else got.float().tolist(), summed.tolist(), dict(calls)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)  # two spawned ranks import torch and form a gloo group: 80 s at load average 9
def test_hidden_states_and_all_reduces_cross_a_real_group_through_host_memory() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_group_rank, args=(rank, port, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = {rank: (got, summed, calls) for rank, got, summed, calls in (results.get(timeout=180) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    expected = (torch.arange(24, dtype=torch.bfloat16).view(1, 3, 8) * 2).float().tolist()
    assert out[1][0] == expected
    for rank in (0, 1):
        assert out[rank][1] == [3.0] * 4
    assert out[0][2] == {"to_host": 2, "to_device": 0}  # the send and the all-reduce
    assert out[1][2] == {"to_host": 1, "to_device": 1}  # the all-reduce, and the received hidden states


# --- memory: reported by the node, counted by placement ----------------------------------------------------------
@NO_GPU
def test_without_a_gpu_no_device_memory_is_reported() -> None:
    assert describe() == {}
    assert device_memory(torch.device("cpu")) is None
    assert available_bytes(torch.device("cpu")) > 0  # the RAM a default KV pool is sized from


def test_the_node_reports_what_torch_sees_of_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert node_info.cuda_accelerator({}) is None
    info = node_info.cuda_accelerator({"name": "NVIDIA H100", "free": 70 * GIB, "total": 80 * GIB})
    assert info is not None
    assert (info.vendor, info.name, info.vram_total_bytes, info.vram_used_bytes) == (
        "nvidia", "NVIDIA H100", 80 * GIB, 10 * GIB)
    node_info.cuda_from_torch.cache_clear()
    monkeypatch.setattr(node_info, "cuda_build", lambda: False)
    try:
        assert node_info.cuda_from_torch() is None  # a CPU build of torch: no child is asked
    finally:
        node_info.cuda_from_torch.cache_clear()


def test_torch_cuda_is_advertised_only_where_the_ranks_use_the_gpu() -> None:
    assert cuda_advertised(True, "nvidia", None)
    assert cuda_advertised(True, "nvidia", "cuda:0")
    assert not cuda_advertised(True, "nvidia", "cpu")  # forced onto the CPU: placement must count RAM
    assert not cuda_advertised(False, "nvidia", None)
    assert not cuda_advertised(True, "amd", None)
    assert not cuda_advertised(True, "cpu", "auto")


@NO_GPU
def test_this_cpu_build_advertises_no_torch_cuda() -> None:
    node_info.backends.cache_clear()
    try:
        assert "torch-cuda" not in node_info.backends()
    finally:
        node_info.backends.cache_clear()


H100 = AcceleratorInfo(vendor="nvidia", name="NVIDIA H100", vram_total_bytes=80 * GIB, vram_used_bytes=76 * GIB)


def gpu_node(accelerator: AcceleratorInfo | None, cuda: bool = True) -> State:
    node = NodeId("gpu")
    return State(
        topology=Topology(nodes=[node]),
        node_memory={node: MemoryUsage(ram_total=Memory.from_gb(2), ram_available=Memory.from_bytes(GIB // 2))},
        node_accelerator={node: accelerator} if accelerator else {},
        node_backends={node: ["torch", "torch-cpu", *(["torch-cuda"] if cuda else [])]},
    )


def test_placement_counts_the_gpu_memory_of_a_torch_cuda_node() -> None:
    """0.5 GiB of free RAM cannot hold the 1 GiB model; the GPU's 4 GiB free can, for a torch rank."""
    node = NodeId("gpu")
    assert gpu_free_bytes(["torch", "torch-cuda"], H100) == 4 * GIB
    assert gpu_free_bytes(["torch", "torch-cpu"], H100) is None
    assert gpu_free_bytes(["torch", "torch-cuda"], AcceleratorInfo(vendor="nvidia")) is None  # size unknown
    assert usable_bytes(gpu_node(H100), node, "torch") == 4 * GIB
    assert usable_bytes(gpu_node(H100), node, "mlx") == GIB // 2  # an MLX rank computes in RAM
    assert usable_bytes(gpu_node(H100, cuda=False), node, "torch") == GIB // 2
    ids = iter(range(10))

    def attempt(state: State) -> object:
        return place(state, CARD, Sharding.Pipeline, InstanceMeta.MlxRing, instance_id=InstanceId("i"),
                     new_runner_id=lambda: RunnerId(f"r{next(ids)}"), rendezvous_port=29500, engine="torch")

    assert isinstance(attempt(gpu_node(H100)), MlxRingInstance)
    assert not isinstance(attempt(gpu_node(H100, cuda=False)), MlxRingInstance)


# --- weight-only quantization in torch's CUDA layouts ------------------------------------------------------------
def test_int4_on_cuda_packs_two_values_a_byte_high_nibble_first() -> None:
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    assert cuda_quant.pack_int4_pairs(q).tolist() == [[0x12, 0xF0], [0x78, 0x9A]]
    assert [cuda_quant.inner_k_tiles(k) for k in (128, 2048, 64, 96, 32)] == [8, 8, 4, 2, 2]
    with pytest.raises(ValueError, match="multiples of 32"):
        cuda_quant.inner_k_tiles(48)


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within 2% of the outputs' largest magnitude: int8's rounding of the weights and bf16's of the result."""
    return float((got - expected).abs().max()) <= 0.02 * float(expected.abs().max())


def test_int8_rows_match_the_dequantized_weights() -> None:
    """The CUDA int8 layout (int8 rows, a bf16 scale per row) computes x @ w.T within int8's rounding; on this CPU
    build torch has no CUDA int8 kernel, so the dequantizing fallback is what runs."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=generator)
    x = torch.randn(3, 128, generator=generator).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator)
    linear = cuda_quant.cuda_int8_from_float(w, 64, bias, torch.device("cpu"))
    assert linear.weight.dtype == torch.int8 and not linear.kernel
    expected = x.float() @ w.t() + bias
    assert close(linear(x).float(), expected)
    q, scales, biases = affine_quantize(w, 8, 64)  # an MLX-style checkpoint's groups, requantized per row
    grouped = cuda_quant.cuda_from_affine(q, scales, biases, 8, 64, None, torch.device("cpu"))
    reference = x.float() @ dequantize(q, scales, biases, 64).t()
    assert close(grouped(x).float(), reference)


def test_a_cuda_rank_never_loads_the_cpu_kernels_layout() -> None:
    """Quantized projections on a non-CPU device take torch's layout (the cuda_quant subclass), never ours."""
    assert issubclass(cuda_quant.CudaQuantizedLinear, cuda_quant.QuantizedLinear)
    linear = cuda_quant.cuda_int8_from_float(torch.randn(8, 64), 64, None, torch.device("meta"))
    assert linear.weight.device.type == "meta" and not linear.kernel


def test_packed_rows_unpack_on_the_device_they_live_on() -> None:
    """An MLX checkpoint's packed embedding is moved to a CUDA rank's device; its rows unpack there (the shifts
    are made on the words' device, not the CPU's)."""
    q = torch.randint(0, 16, (3, 16), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    assert torch.equal(unpack_mlx(pack_mlx(q, 4), 4), q)
    off = unpack_mlx(pack_mlx(q, 4).to("meta"), 4)
    assert off.device.type == "meta" and off.shape == q.shape
