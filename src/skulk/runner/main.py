"""The runner process's entry: heartbeat, logging, orphan watch, then the runner the model card calls for.

`runner.core.Runner` (text generation) and `runner.embedder.EmbeddingRunner` (its subclass) live below this module:
it imports both, neither imports it, so the runner package has no import circle."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

from skulk.runner.channel import Letters, Outbox, Source
from skulk.runner.core import Runner
from skulk.runner.messages import RUNNER_HEARTBEAT_S, Heartbeat
from skulk.runner.spec import RunnerSpec
from skulk.types.errors import clip_text

log = logging.getLogger("skulk.runner")

GOMP_SPINCOUNT = "1000"
"""How long torch's idle OpenMP workers spin before they sleep, in every runner (runner_main says why); benches
that compare a runner with an engine in their own process give that process the same."""


WARM_IMPORTS: dict[str, tuple[str, ...]] = {
    "torch": ("torch", "transformers", "skulk.engines.torch.engine", "skulk.runner.group"),
    "mlx": ("mlx.core", "skulk.engines.mlx.build"),
}
"""What a spare runner imports before it is needed, by the engine its node prefers: the seconds of CPU a
runner spends before it can read weights (2.7 CPU-s for torch and transformers alone; issue 38)."""


def spare_main(engine: str, inbox: Connection, pipe: Connection, parent: int | None = None) -> None:
    """Process entry point of a spare runner (worker/spare.py): import the engine's modules, then wait, silent, for
    the spec of the runner it is to become (the first message on `inbox`) and run that runner as runner_main would.
    It says nothing before then: nobody reads its pipe until a supervisor takes it."""
    configure_logging()
    _exit_with_parent(parent)
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)  # before torch loads OpenMP (runner_main says why)
    for module in WARM_IMPORTS.get(engine, ()):
        try:
            importlib.import_module(module)
        except ImportError:  # an engine this host lacks: the runner it becomes imports what it needs
            break
    letters = Letters(inbox)
    try:
        spec = letters.get()
    except EOFError:
        os._exit(0)
    if not isinstance(spec, RunnerSpec):  # anything else is a stop: the pool let it go unused
        os._exit(0)
    runner_main(spec, letters, pipe)  # from here only ToRunner messages come


def runner_main(spec: RunnerSpec, inbox: Connection | Source, pipe: Connection, parent: int | None = None) -> None:
    """Process entry point (multiprocessing spawn target): tasks come in on `inbox` (the read end of the node's
    pipe, or a spare's reader of it), everything the runner says goes out on the write end of `pipe`
    (channel.Outbox)."""
    outbox = Outbox(pipe)
    _heartbeat(outbox)  # first: the supervisor's hung-runner clock starts with the first message it hears
    configure_logging()
    _exit_with_parent(parent)
    # Before torch loads OpenMP, bound how long its idle workers spin (1000 rounds, tens of microseconds) before
    # they sleep, so a step's back-to-back parallel regions still find their workers awake but cores other work
    # wants are left to it. Ranks of an instance that share a host take turns computing (bench/cluster.py on 2
    # cores: 2 ranks ÷ 1 rank 0.92, 3 ranks 0.90; PASSIVE 0.95, 0.82, and a 2-thread int4 decode step 34 ms
    # instead of 20). A single rank on a busy host (issue 43; bench/serving.py --load 2 on 2 cores at load
    # average ~9): libgomp's default spin (300000 rounds while threads <= cores) took 0.7 tok/s at 1 stream,
    # 8.9 at 16 and 21.6 at 64; with 1000 rounds 18.3, 158.8 and 174.3.
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    runner = _new_runner(spec, Letters(inbox) if isinstance(inbox, Connection) else inbox, outbox)
    try:
        runner.start()
        runner.serve()
    except Exception as exc:  # the supervisor turns a non-zero exit into RunnerFailed
        runner.recorder.record("error", "runner_crashed", clip_text(repr(exc), 200))
        runner.flush()
        if peer_gone(exc):  # expected when a node of the instance dies: one line, not a stack trace
            log.error("runner %s stopped: a peer rank is gone (%s)", spec.runner_id, first_line(exc))
        else:
            log.exception("runner %s crashed", spec.runner_id)
        _leave(outbox, 1)
    _leave(outbox)


PEER_GONE_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused",
                   "socket closed", "end of file", "connection was likely closed", "failed to recv")


def peer_gone(exc: BaseException) -> bool:
    """The rank failed because another rank's process or node went away (a socket error, or torch.distributed
    / gloo's RuntimeError saying so): the master retries or re-places the instance; its trace says nothing."""
    if isinstance(exc, ConnectionError | EOFError) or type(exc).__name__ == "DistNetworkError":
        return True  # DistNetworkError: torch.distributed's store lost its peer (no torch import here)
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in PEER_GONE_WORDS)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {clip_text(text[0], 200)}" if text else type(exc).__name__


def _leave(outbox: Outbox, code: int = 0) -> None:
    """A stop skips the interpreter's teardown, which spends seconds collecting torch's objects on a loaded
    machine (past the supervisor's stop grace) and can wait forever on MLX's ring threads after a peer died:
    every message was written whole when it was sent, so the process ends once the pipe is closed."""
    outbox.close()
    logging.shutdown()
    os._exit(code)


def _new_runner(spec: RunnerSpec, inbox: Source, outbox: Outbox) -> Runner:
    """An embedding model's runner answers embeddings with its encoder; every other runner generates text."""
    if spec.shard.model_card.embeds:
        from skulk.runner.embedder import EmbeddingRunner

        return EmbeddingRunner(spec, inbox, outbox)
    return Runner(spec, inbox, outbox)


def configure_logging() -> None:
    """Runner lines on stderr keep their level: operators grep for CRITICAL (a warmup overrun, runbook 004)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)-7s runner: %(message)s")


def _heartbeat(outbox: Outbox) -> None:
    """Tell the supervisor every RUNNER_HEARTBEAT_S that the process is alive, from a daemon thread of its own:
    a long prefill keeps it going, a frozen (SIGSTOPped) or dead process does not."""

    def beat() -> None:
        while True:
            try:
                outbox.put(Heartbeat())
            except (OSError, ValueError):  # the queue is closed: the process is ending
                return
            time.sleep(RUNNER_HEARTBEAT_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


_watching_parent = False


def _exit_with_parent(parent: int | None = None) -> None:
    """A node killed with SIGKILL cannot stop its runners; they notice the orphaning and exit themselves (one
    watch per process: a spare that becomes a runner already has it). `parent`: the node's pid as it spawned
    the process. Read here instead, a node killed while its child was still starting (spawn's own imports come
    first) would already be gone, the child's parent would read as init, and the child would wait forever (a
    spare spawned just before its node's kill -9 outlived it)."""
    global _watching_parent
    if _watching_parent:
        return
    _watching_parent = True
    parent = parent or os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(4)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()

