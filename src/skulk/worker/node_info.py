"""What this machine is and has, read through psutil and the platform. Runs off the event loop."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import psutil

from skulk import __version__, memory_limit
from skulk.types.backends import TORCH_DEVICE_ENV, BackendTag, EngineName, cuda_advertised, engine_of
from skulk.types.memory import Memory
from skulk.types.node_info import (
    AcceleratorInfo,
    DiskUsage,
    InterfaceType,
    MemoryUsage,
    NetworkInfo,
    NetworkInterface,
    NodeIdentity,
    NodeInfo,
    RunnerOverhead,
    SystemPerformance,
)
from skulk.worker.oom import oom_kills


@cache
def skulk_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
        return out.stdout.strip() or "Unknown"
    except (OSError, subprocess.SubprocessError):
        return "Unknown"


def identity(friendly_name: str | None) -> NodeIdentity:
    return NodeIdentity(
        model_id=platform.machine() or "Unknown",
        chip_id=platform.processor() or platform.machine() or "Unknown",
        friendly_name=friendly_name or socket.gethostname(),
        os_version=f"{platform.system()} {platform.release()}",
        os_build_version=platform.version(),
        skulk_version=__version__,
        skulk_commit=skulk_commit(),
    )


@cache
def gpu_working_set() -> int | None:
    """On Apple silicon, the bytes Metal recommends the GPU keep resident (MLX's max_recommended_working_set_size,
    what Skulk and exo place against): a model larger than this pages on every step even with RAM free."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return None
    code = "import mlx.core as mx; print(int(mx.device_info()['max_recommended_working_set_size']))"
    try:  # a child interpreter: the node keeps MLX out of its own memory
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
        return int(run.stdout.strip()) if run.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):  # no MLX: torch on the CPU, RAM is what counts
        return None


def memory(limit: str | None = None, reserve: str = memory_limit.DEFAULT_RESERVE,
           watch: memory_limit.MemoryWatch | None = None, standby: int = 0) -> MemoryUsage:
    """The node's memory as it may use it (memory_limit.budget): its limit (the machine, its cgroup, a Mac's GPU
    working set or `limit`, the smallest) and what is free under it less `reserve`; with `watch`, the signs of
    trouble too (paging, OOM kills)."""
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    configured = memory_limit.parse_amount(limit) if limit else None
    found = memory_limit.budget(vm.total, vm.available, memory_limit.this_cgroup(), gpu_working_set(), configured,
                                memory_limit.parse_amount(reserve),
                                memory_limit.own_use() if configured is not None else 0, standby)
    usage = MemoryUsage(
        ram_total=Memory.from_bytes(found.limit),
        ram_available=Memory.from_bytes(found.free),
        swap_total=Memory.from_bytes(sw.total),
        swap_available=Memory.from_bytes(sw.free),
        ram_used=Memory.from_bytes(found.used),
        ram_reserved=Memory.from_bytes(found.reserved),
        limit_source=found.source,
    )
    if watch is not None:
        rate, kills = watch.sample(time.monotonic(), memory_limit.major_faults(memory_limit.family()), oom_kills())
        usage = usage.model_copy(update={"major_faults_per_s": rate, "oom_kills": kills})
    return usage


def disk(path: Path) -> DiskUsage:
    path.mkdir(parents=True, exist_ok=True)
    usage = psutil.disk_usage(str(path))
    return DiskUsage(total=Memory.from_bytes(usage.total), available=Memory.from_bytes(usage.free))


def _interface_type(name: str) -> InterfaceType:
    if name.startswith(("wl", "wlan")):
        return "wifi"
    if name.startswith(("en", "eth")):
        return "ethernet"
    if name.startswith(("thunderbolt", "tb")):
        return "thunderbolt"
    if name.startswith(("veth", "br", "docker")):
        return "maybe_ethernet"
    return "unknown"


def network() -> NetworkInfo:
    interfaces = [
        NetworkInterface(name=name, ip_address=addr.address, interface_type=_interface_type(name))
        for name, addrs in psutil.net_if_addrs().items()
        for addr in addrs
        if addr.family == socket.AF_INET
    ]
    return NetworkInfo(interfaces=interfaces)


AMD_VENDOR = "0x1002"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def amd_accelerator(sys_root: Path = Path("/sys")) -> AcceleratorInfo | None:
    """An AMD GPU through amdgpu's sysfs files (/sys/class/drm/card*/device/mem_info_*): VRAM, and the GTT an
    APU maps system RAM through (seed 002: gttTotalBytes, which placement counts on unified-memory nodes). The
    card with the most GTT+VRAM wins; None without an amdgpu card."""
    best: tuple[int, AcceleratorInfo] | None = None
    for device in sorted((sys_root / "class" / "drm").glob("card*/device")):
        vendor = (device / "vendor").read_text().strip() if (device / "vendor").is_file() else ""
        vram, gtt = _read_int(device / "mem_info_vram_total"), _read_int(device / "mem_info_gtt_total")
        if vendor != AMD_VENDOR or (vram is None and gtt is None):
            continue
        busy = _read_int(device / "gpu_busy_percent")
        info = AcceleratorInfo(
            vendor="amd",
            name=(device / "product_name").read_text().strip() if (device / "product_name").is_file() else "AMD GPU",
            utilization_ratio=busy / 100.0 if busy is not None else None,
            vram_total_bytes=vram,
            vram_used_bytes=_read_int(device / "mem_info_vram_used"),
            gtt_total_bytes=gtt,
        )
        size = (vram or 0) + (gtt or 0)
        if best is None or size > best[0]:
            best = (size, info)
    return best[1] if best is not None else None


def accelerator() -> AcceleratorInfo:
    """NVIDIA through NVML when it is installed; AMD through amdgpu's sysfs files; otherwise the CPU."""
    amd = amd_accelerator()
    if amd is not None:
        return amd
    try:
        pynvml = _pynvml()
        if pynvml is None:
            raise ImportError("nvidia-ml-py is not installed")
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return AcceleratorInfo(
            vendor="nvidia",
            name=str(pynvml.nvmlDeviceGetName(handle)),
            utilization_ratio=util.gpu / 100.0,
            vram_total_bytes=int(mem.total),
            vram_used_bytes=int(mem.used),
        )
    except Exception:
        cpu = AcceleratorInfo(vendor="cpu", name=platform.processor() or platform.machine() or "cpu")
        return cuda_from_torch() or cpu


@cache
def _pynvml() -> Any | None:
    """NVML's Python module, or None where it is not installed. Asked once: Python does not remember a failed
    import, and looking for it walked sys.path on every gather (about 1.3 ms of an idle node's 15 ms a second)."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml


def cuda_build() -> bool:
    """The installed torch is a CUDA build (its version has no +cpu local tag), read without importing it."""
    try:
        return "+cpu" not in importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False


@cache
def cuda_from_torch() -> AcceleratorInfo | None:
    """The GPU as torch sees it, where NVML (nvidia-ml-py) is not installed: a child interpreter asks
    torch.cuda.mem_get_info (engines/torch/device.py), since the node never imports torch, and a CUDA context in it
    would hold GPU memory for good. Asked once: its used bytes are those before any rank loaded; NVML's are live."""
    if not cuda_build():
        return None
    try:
        out = subprocess.run([sys.executable, "-m", "skulk.engines.torch.device"], capture_output=True, text=True,
                             timeout=120, check=True)
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return cuda_accelerator(facts)


def cuda_accelerator(facts: dict[str, object]) -> AcceleratorInfo | None:
    """An NVIDIA accelerator from device.describe()'s {name, free, total} (None for {}: torch sees no GPU)."""
    if not facts:
        return None
    total, free = int(str(facts["total"])), int(str(facts["free"]))
    return AcceleratorInfo(vendor="nvidia", name=str(facts["name"]), vram_total_bytes=total,
                           vram_used_bytes=max(0, total - free))


def system() -> SystemPerformance:
    return SystemPerformance(pcpu_usage=psutil.cpu_percent(interval=None))


@cache
def backends(only: tuple[EngineName, ...] = ()) -> list[BackendTag]:
    """The backend tags this node runs, bare engine tags included: torch always (Skulk's own dependency; cuda
    when the build has it, an NVIDIA GPU is present and SKULK_TORCH_DEVICE does not keep torch on the CPU), MLX
    when it imports and computes here (engines/mlx); only the engines in `only` when it names any
    (SKULK_ENGINES)."""
    if only:
        return [t for t in backends() if engine_of(t) in only]
    from skulk.engines import mlx as mlx_engine

    tags: list[BackendTag] = ["torch", "torch-cpu"]
    if cuda_build() and cuda_advertised(True, accelerator().vendor, os.environ.get(TORCH_DEVICE_ENV)):
        tags.append("torch-cuda")
    if mlx_engine.probe() is None:
        metal: list[BackendTag] = ["mlx", "mlx-metal"]
        cpu: list[BackendTag] = ["mlx", "mlx-cpu"]
        tags += metal if mlx_engine.is_metal() else cpu
    return tags


def gather(*, friendly_name: str | None, home: Path, api_port: int, engines: tuple[EngineName, ...] = (),
           limit: str | None = None, reserve: str = memory_limit.DEFAULT_RESERVE,
           watch: memory_limit.MemoryWatch | None = None, standby: int = 0,
           overheads: list[RunnerOverhead] | None = None) -> NodeInfo:
    """standby: the spare runner's resident bytes (memory_limit.budget says why they count as free); overheads:
    what this node's runners measured they hold besides weights and KV (worker/overheads.py)."""
    mem = memory(limit, reserve, watch, standby)
    return NodeInfo(
        backends=backends(engines),
        identity=identity(friendly_name),
        memory=mem.model_copy(update={"runner_overheads": overheads}) if overheads else mem,
        disk=disk(home),
        system=system(),
        accelerator=accelerator(),
        network=network(),
        api_port=api_port,
    )


MEMORY_STEP = 64 * 1024 * 1024


def differs(old: NodeInfo | None, new: NodeInfo) -> bool:
    """Worth an event: anything but memory and CPU changed, free memory moved by more than 64 MiB, or the signs
    of memory trouble or the runners' measured overheads changed."""
    if old is None or old.memory is None or new.memory is None:
        return True
    moved = abs(old.memory.ram_available.in_bytes - new.memory.ram_available.in_bytes) > MEMORY_STEP
    trouble = old.memory.oom_kills != new.memory.oom_kills or old.memory.paging != new.memory.paging
    measured = old.memory.runner_overheads != new.memory.runner_overheads  # placement counts them
    strip = {"memory", "system"}
    return moved or trouble or measured or old.model_dump(exclude=strip) != new.model_dump(exclude=strip)
