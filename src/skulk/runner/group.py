"""The tensor plane of one instance: its ranks form a torch.distributed process group.

Why an explicit TCPStore rather than `init_method="tcp://host:port"` (which builds the same store inside
torch): the runner keeps the store handle, so slow-loading ranks can meet at a load barrier by polling the
store (no collective, so no op timeout) and only then start the collectives that run under the short
`op_timeout_s`. The short timeout is what turns a hung peer into an error within seconds; a killed peer
closes its sockets and gloo raises at once. Either way the error leaves the engine as an exception, the
runner process exits non-zero, the supervisor reports RunnerFailed and the master restarts the instance as a
whole (or, over its restart budget, marks it failed). Store keys are per attempt (a PrefixStore), so a rank
restarted with its instance never reads what the previous group left behind.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.fallback import FallbackEngine
from skulk.runner.recorder import FlightRecorder
from skulk.runner.spec import RunnerSpec
from skulk.types.errors import clip_text
from skulk.types.instances import Sharding

# A hung peer must be noticed in <= 10 s; idle ranks exchange heartbeats well inside this. A stage whose
# prefill alone runs longer (huge prompts on CPU) needs more: SKULK_GROUP_TIMEOUT_SECONDS (group_timeout_seconds,
# carried to the runner in its spec) raises it.
LOAD_POLL_S = 0.05


class GroupError(RuntimeError):
    """The group could not form, or a peer vanished before it was ready."""


@dataclass
class Group:
    """A formed group: the default process group (tensors) plus a gloo group for control messages.

    On CPU both are the same gloo group; with NCCL the step headers and token ids still travel over gloo so
    the control path never waits on a CUDA stream.
    """

    rank: int
    world_size: int
    backend: str
    store: Any  # torch.distributed.TCPStore
    control: Any  # ProcessGroup used for headers and token ids
    op_timeout_s: float

    def wait_all_loaded(self, deadline_s: float) -> None:
        """Meet the other ranks after loading: a store counter, polled, so no collective can time out while a
        slow rank is still reading weights."""
        self.store.add("skulk/loaded", 1)
        deadline = time.monotonic() + deadline_s
        while int(self.store.add("skulk/loaded", 0)) < self.world_size:
            if time.monotonic() > deadline:
                raise GroupError(f"peers did not finish loading within {deadline_s:.0f} s")
            time.sleep(LOAD_POLL_S)

    def destroy(self) -> None:
        """Leave the group; safe to call twice and after a peer has died."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass


def interface_towards(host: str) -> str | None:
    """The name of the local interface this machine uses to reach `host`, or None if it cannot tell.

    Gloo advertises the address its hostname resolves to unless told otherwise, and on many LANs (Debian's
    default /etc/hosts) that is 127.0.1.1: the peer on the other machine then dials loopback and the group never
    forms. Binding gloo to the interface that routes to the rendezvous host is what works on a real LAN."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    return None


def listen_on(host: str, port: int) -> int:
    """A listening socket on exactly the rendezvous address placement chose, handed to the store by fd.

    Left to itself torch's store listens on every interface, so any host that can reach the port could talk to
    it; bound here, only the interface the peers were placed to use is open."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def choose_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" and torch.cuda.is_available() else "gloo"


def connect_group(
    spec: RunnerSpec,
    recorder: FlightRecorder,
    *,
    device: torch.device | str = "cpu",
    timeout_s: float | None = None,
) -> Group:
    """Form the instance's group at its rendezvous (rank 0 hosts the store) within spec.connect_deadline_s."""
    shard, rendezvous = spec.shard, spec.rendezvous
    if rendezvous is None:
        raise GroupError(f"instance {spec.instance_id} has world_size {shard.world_size} but no rendezvous")
    rank, world = shard.device_rank, shard.world_size
    backend = choose_backend(torch.device(device))
    op_timeout = timeout_s if timeout_s is not None else spec.group_timeout_s
    where = f"{rendezvous.host}:{rendezvous.port}"
    recorder.record("connect_group", "connect_started", where, rank=rank, world_size=world, backend=backend)
    started = time.monotonic()
    interface = interface_towards(rendezvous.host)
    if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # this process only: a runner forms one group
    try:
        tcp_store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            rendezvous.host, rendezvous.port, world, is_master=rank == 0,
            timeout=timedelta(seconds=spec.connect_deadline_s), wait_for_workers=True,
            master_listen_fd=listen_on(rendezvous.host, rendezvous.port) if rank == 0 else None,
        )
        # keys per attempt: a rank restarted with its instance never reads what an older group left behind
        store = dist.PrefixStore(f"skulk/attempt{spec.attempt}/", tcp_store)  # pyright: ignore[reportPrivateImportUsage]
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=op_timeout)
        )
    except (RuntimeError, ValueError, OSError) as exc:
        recorder.record("connect_group", "connect_failed", clip_text(repr(exc), 200))
        raise GroupError(f"could not form the group at {where} within {spec.connect_deadline_s:.0f} s") from exc
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=op_timeout)) if backend != "gloo" else None
    recorder.record("connect_group", "connected", where, seconds=round(time.monotonic() - started, 3))
    return Group(rank, world, backend, store, control or dist.group.WORLD, op_timeout)


def build_engine(spec: RunnerSpec, group: Group, *,
                 device: torch.device | str | None = None) -> TorchEngine | FallbackEngine:
    """This rank's engine over the formed group: its layer range for Pipeline, all layers sharded for Tensor. In a
    mixed instance an MLX rank is the torch engine's core computing with mlx-lm (engines/mlx/mixed.py), and no
    rank shares cached prefixes (that rank keeps a cache per request). device: a torch rank's, else the one
    SKULK_TORCH_DEVICE picks (engines/torch/device.py: a GPU when there is one); an MLX rank's core stays on the
    CPU. The group is gloo either way, so CUDA and CPU ranks share one Pipeline (hidden states cross in host
    memory, links.GroupLink)."""
    from skulk.engines.torch.device import engine_device

    shard = spec.shard
    if shard.model_card.torch_runtime == "transformers":  # a Pipeline of transformers' modeling, on the CPU
        from skulk.engines.torch.fallback import FallbackEngine

        return FallbackEngine(spec.model_dir, max_seq=spec.context_length, rank=shard.device_rank,
                              world_size=shard.world_size, start_layer=shard.start_layer, end_layer=shard.end_layer,
                              control_group=group.control, kv_cache_bytes=spec.kv_cache_bytes)
    make: type[TorchEngine] = TorchEngine
    if spec.mixed and spec.engine == "mlx":
        from skulk.engines.mlx.mixed import MixedMlxEngine

        make = MixedMlxEngine
        device = "cpu"
    elif device is None:
        device = engine_device()
    engine = make(
        spec.model_dir,
        rank=shard.device_rank,
        world_size=shard.world_size,
        kind="tensor" if spec.sharding == Sharding.Tensor else "pipeline",
        start_layer=shard.start_layer,
        end_layer=shard.end_layer,
        control_group=group.control,
        prefill_chunk=spec.prefill_chunk_tokens,
        device=device,
        quantize=shard.model_card.quantize_at_load,
        max_seq=spec.context_length,
        kv_cache_bytes=spec.kv_cache_bytes,
        kv_cache_bits=shard.model_card.kv_cache_bits,
    )
    if spec.mixed:
        engine.share_prefixes = False
    return engine
