"""Which device a torch rank computes on, chosen once per runner, and the few things that differ by device.

A rank's weights, KV cache and sampling live on one device: `engine_device` picks it when the runner builds its
engine (SKULK_TORCH_DEVICE: auto, the default, is CUDA when torch sees a GPU, else the CPU; cpu, cuda or cuda:N
force one, and a forced CUDA device that is not there is an error that says so, never a silent CPU run). The
choice is a pure function of the setting and what torch sees (`resolve_device`), so it is tested without a GPU.

What differs by device:
- the C kernels (cpu_kernels.py, cpu_step.c) read CPU memory only: `uses_c_kernels` is the one decision, and
  cpu_kernels.handles asks it, so on CUDA every layer takes torch's op-by-op path (the C layer stack, the fused
  decode layer, our quantized matmuls are never chosen);
- paged attention on CUDA is that same torch path over the block table (cache.py gathers a step's blocks, then
  scaled_dot_product_attention): correct everywhere, a first version; a kernel that reads the block table itself
  (flex attention, a paged-attention package) is the follow-up where the GPU run shows attention dominating;
- hidden states cross the wire from host memory (the group is gloo, so a Pipeline mixes CUDA, CPU and MLX ranks):
  `to_host` before a send, `to_device` after a receive, both no-ops on the CPU;
- a default KV pool is sized from the device's free memory (`available_bytes`), not the host's RAM.

`python -m skulk.engines.torch.device` prints the GPU's name and memory as JSON ({} without one): the node never
imports torch (tests/unit/test_layering.py), so it asks a child when NVML is not installed (worker/node_info.py).
"""

from __future__ import annotations

import json
import os

import torch

from skulk import memory_limit
from skulk.types.backends import TORCH_DEVICE_ENV, torch_device_setting

DEVICE_ENV = TORCH_DEVICE_ENV
"""auto (default), cpu, cuda or cuda:N: the device a torch rank computes on (config.Settings.torch_device)."""


class DeviceUnavailable(ValueError):
    """The device setting names something this machine cannot compute on, or is not a device at all."""


def check_setting(setting: str) -> str:
    """The setting, normalised (lower case, no spaces); DeviceUnavailable when it is not one of the forms."""
    try:
        return torch_device_setting(setting)
    except ValueError as exc:
        raise DeviceUnavailable(str(exc)) from None


def resolve_device(setting: str | None, cuda_devices: int) -> torch.device:
    """The device for a setting (None or empty: auto) on a machine where torch sees cuda_devices GPUs: auto is
    cuda:0 when there is one, else the CPU; a forced CUDA device must exist."""
    value = check_setting(setting or "auto")
    if value == "auto":
        return torch.device("cuda", 0) if cuda_devices > 0 else torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    index = int(value.partition(":")[2] or 0)
    if index >= cuda_devices:
        seen = f"{cuda_devices} CUDA device(s)" if cuda_devices else "no CUDA device (a CPU build of torch, no driver)"
        raise DeviceUnavailable(f"{DEVICE_ENV}={setting!r}: torch sees {seen}")
    return torch.device("cuda", index)


def engine_device(setting: str | None = None) -> torch.device:
    """The device this process's torch ranks compute on: setting, else SKULK_TORCH_DEVICE, else auto."""
    chosen = setting if setting is not None else os.environ.get(DEVICE_ENV)
    return resolve_device(chosen, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def uses_c_kernels(device: torch.device) -> bool:
    """True where our C kernels may run: they read and write CPU memory only, so any other device takes torch's
    op-by-op path. Pure: a torch.device("cuda") object answers without a GPU."""
    return device.type == "cpu"


def to_host(x: torch.Tensor) -> torch.Tensor:
    """x in host memory, to go on the wire (the group is gloo): the same tensor on the CPU, else a synchronous
    copy (the copy waits for the kernels that computed x, so what is sent is complete)."""
    return x if x.device.type == "cpu" else x.to("cpu")


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x, received into host memory, on the rank's device: the same tensor when that is the CPU."""
    return x if x.device == device else x.to(device)


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (torch.cuda.mem_get_info); None for the CPU, whose memory is RAM."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def available_bytes(device: torch.device) -> int:
    """Free memory a default KV pool is sized from: the device's own on a GPU, else this process's RAM."""
    memory = device_memory(device)
    return memory[0] if memory is not None else memory_limit.available_now()


def describe() -> dict[str, object]:
    """The first CUDA device as the node reports it ({} when torch sees none): name, free and total bytes."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return {}
    memory = device_memory(torch.device("cuda", 0))
    assert memory is not None
    return {"name": torch.cuda.get_device_name(0), "free": memory[0], "total": memory[1]}


if __name__ == "__main__":
    print(json.dumps(describe()))
