"""How a node runs a model, in Skulk 1.3.0's vocabulary: backend tags `<engine>-<compute>`.

A node advertises every tag it can run, the bare engine tag included (`torch`, `torch-cpu`, `mlx`, `mlx-metal`,
...); a model card may restrict the engines that can run it (`compatible_backends`, a hard filter) and order them
(`backend_preference`, a soft order); a placement request names an engine or leaves it to `auto`.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

EngineName = Literal["torch", "mlx"]
BackendTag = Literal["torch", "torch-cpu", "torch-cuda", "mlx", "mlx-metal", "mlx-cpu"]
EngineChoice = Literal["auto", "torch", "mlx"]
"""`auto`: each placement its best engine (MLX where every node computes on Metal, torch elsewhere)."""

ENGINES: tuple[EngineName, ...] = get_args(EngineName)
INSTALL: dict[EngineName, str] = {
    "torch": "pip install torch==2.13.0 (Skulk's own dependency)",
    "mlx": "pip install mlx mlx-lm on macOS arm64, pip install 'mlx[cpu]' mlx-lm on Linux (x86_64, aarch64)",
}
"""What to install on a node that lacks an engine, for the refusal that names it."""
ENGINE_LABELS: dict[EngineName, str] = {"torch": "the torch engine", "mlx": "the MLX engine (mlx-lm)"}
ENGINE_TAGS: dict[EngineName, tuple[BackendTag, ...]] = {
    "torch": ("torch", "torch-cpu", "torch-cuda"),
    "mlx": ("mlx", "mlx-metal", "mlx-cpu"),
}
"""Every tag of an engine: a card restricted to an engine allows each of them (its bare tag and computes)."""


def engine_of(tag: str) -> EngineName | None:
    """The engine a tag names (`mlx-metal` → `mlx`); None for a tag of an engine this build does not know."""
    head = tag.split("-", 1)[0]
    return next((e for e in ENGINES if e == head), None)


def engines_of(tags: list[BackendTag] | list[str]) -> set[EngineName]:
    return {e for t in tags if (e := engine_of(t)) is not None}


def backends_for(engines: tuple[EngineName, ...] | list[EngineName]) -> list[BackendTag] | None:
    """A card's compatible_backends for the engines that run its family: None (any) when every engine does,
    else every tag of those engines."""
    if set(ENGINES) <= set(engines):
        return None
    return [t for e in ENGINES if e in engines for t in ENGINE_TAGS[e]]


def allows(compatible: list[BackendTag] | None, engine: EngineName) -> bool:
    """A card's compatible_backends admit some tag of this engine (None: every engine)."""
    return compatible is None or any(engine_of(t) == engine for t in compatible)


TORCH_DEVICE_ENV = "SKULK_TORCH_DEVICE"
"""auto (default), cpu, cuda or cuda:N: the device a node's torch ranks compute on (engines/torch/device.py)."""
TORCH_DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_TORCH_DEVICES = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def torch_device_setting(value: str) -> str:
    """The device setting normalised (lower case, trimmed); ValueError naming the forms when it is none of them.
    Pure text: the node checks it without importing torch, the runner resolves it against what torch sees."""
    normal = value.strip().lower()
    if not _TORCH_DEVICES.match(normal):
        raise ValueError(f"{TORCH_DEVICE_ENV}={value!r}: expected {TORCH_DEVICE_CHOICES}")
    return normal


def cuda_advertised(cuda_build: bool, vendor: str, setting: str | None) -> bool:
    """Whether a node advertises torch-cuda: a CUDA build of torch, an NVIDIA GPU, and a device setting that does
    not keep torch on the CPU (SKULK_TORCH_DEVICE=cpu: the ranks would not use the GPU, so placement must not
    count its memory)."""
    return cuda_build and vendor == "nvidia" and torch_device_setting(setting or "auto") != "cpu"
