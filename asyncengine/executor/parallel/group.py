"""The worker processes of rank 0's node: start, watch, stop.

Workers are ``spawn``ed processes (``worker.run_worker``). Rank 0 watches their sentinels from
a thread (:meth:`WorkerGroup.wait_for_death`): a worker that exits while the engine runs
fails the engine at once (every in-flight request gets an error; ``serve`` exits non-zero),
whether or not a step is in flight. A step blocked in a collective with the dead rank ends
with the connection's error, or at the model group's timeout; shutdown kills the remaining
workers first, so the device thread is never waited on for long.

Start-up waits (the rendezvous, the exchange of the KV-cache size) run in a helper thread
while the caller watches the workers: a worker that fails to start (a bad checkpoint, out of
memory) fails ``build`` with its exit code instead of a two-minute rendezvous timeout.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from asyncengine.config import EngineConfig

logger = logging.getLogger("asyncengine")

T = TypeVar("T")
#: Seconds shutdown waits for the device thread, then for each worker, before killing it.
STOP_TIMEOUT_S = 5.0


class WorkerDied(RuntimeError):
    pass


class WorkerGroup:
    def __init__(self, config: EngineConfig, ranks: list[int], world_size: int,
                 init_method: str, num_threads: int | None) -> None:
        from asyncengine.executor.parallel.worker import run_worker

        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=run_worker, name=f"asyncengine-tp{rank}",
                                  args=(config, rank, world_size, init_method, num_threads),
                                  daemon=True) for rank in ranks]
        self.ranks = ranks
        self.closing = False
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        for p in self.procs:
            p.start()
        logger.info("tensor parallel: started worker ranks %s (pids %s), rendezvous %s",
                    ranks, [p.pid for p in self.procs], init_method)

    # -- liveness ---------------------------------------------------------------------------
    def dead(self) -> str | None:
        """A description of the first worker that has exited, or None."""
        for rank, p in zip(self.ranks, self.procs, strict=True):
            if p.exitcode is not None:
                return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with " \
                       f"code {p.exitcode}"
        return None

    def wait_for_death(self) -> str | None:
        """Block until a worker exits (its description) or :meth:`close` begins (None)."""
        sentinels = [p.sentinel for p in self.procs] + [self._wake_r]
        while True:
            multiprocessing.connection.wait(sentinels)
            if self.closing:
                return None
            died = self.dead()
            if died is not None:
                return died

    def while_alive(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` in a helper thread; raise WorkerDied as soon as a worker exits first."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised below
                box["error"] = e

        thread = threading.Thread(target=target, name="asyncengine-tp-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            died = self.dead()
            if died is not None and thread.is_alive():
                raise WorkerDied(f"{died} while {what}")
        if "error" in box:
            raise box["error"]
        return box["value"]

    # -- shutdown ---------------------------------------------------------------------------
    def close(self, kill: bool = False) -> None:
        """Stop watching; with ``kill``, end every worker now (after a failure)."""
        self.closing = True
        self._wake_w.send(None)
        if kill:
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()

    def join(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the workers to exit (they were told to stop); kill the late ones."""
        for p in self.procs:
            p.join(timeout)
            if p.exitcode is None:
                logger.warning("tensor-parallel worker pid %d did not stop: killed", p.pid)
                p.kill()
                p.join(1.0)
        for c in (self._wake_r, self._wake_w):
            c.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads of each rank: ``--num-threads``, or this node's cores shared evenly."""
    pc = config.parallel
    local = pc.tensor_parallel_size // pc.nnodes
    return config.device.num_threads or max(1, (os.cpu_count() or 1) // local)
