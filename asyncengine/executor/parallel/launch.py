"""Starting tensor parallelism: rank 0's side (``build``) and a worker-only node.

One node (the default): ``asyncengine serve --tensor-parallel-size N`` is rank 0; it spawns
ranks 1..N-1 and they meet at ``--distributed-init-method`` (default: a free port on
127.0.0.1). Several nodes: every node runs the same command with ``--nnodes M --node-rank K``
and node 0's address as ``--distributed-init-method tcp://HOST:PORT``; node K runs ranks
``K * N/M .. (K + 1) * N/M - 1``. Node 0 (rank 0 among its ranks) serves; the other nodes
only run workers (:func:`serve_worker_node`) and exit when rank 0 stops them or goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch.distributed as dist

from asyncengine.config import EngineConfig
from asyncengine.executor.parallel.group import STOP_TIMEOUT_S, WorkerGroup, threads_per_rank
from asyncengine.executor.parallel.state import TPState, free_init_method, init_distributed

logger = logging.getLogger("asyncengine")


@dataclass
class TensorParallel:
    """Rank 0's handle on the group: its state and its node's worker processes."""

    tp: TPState
    workers: WorkerGroup
    closed: bool = False

    def exchange_setup(self, num_blocks: int, max_model_len: int) -> None:
        """Send the KV-cache size to the workers and wait until every one is ready."""
        def exchange() -> None:
            setup = [{"num_blocks": num_blocks, "max_model_len": max_model_len}]
            dist.broadcast_object_list(setup, src=0, group=self.tp.control_group)
            dist.barrier(group=self.tp.control_group)

        self.workers.while_alive(exchange, "loading the model's shards")

    def abort(self) -> None:
        """Start-up failed on rank 0: end the workers."""
        self.closed = True
        self.workers.close(kill=True)
        self.workers.join(1.0)
        _leave_group()

    def watch(self) -> None:
        """Start the one thread that waits on the workers' sentinels (after start-up)."""
        self._waiters: list[tuple[asyncio.AbstractEventLoop, anyio.Event]] = []
        self._lock = threading.Lock()
        self.died: str | None = None
        threading.Thread(target=self._watch, name="asyncengine-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        died = self.workers.wait_for_death()
        with self._lock:
            self.died = died
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(event.set)

    async def wait_for_death(self) -> str | None:
        """Wait until a worker exits: what happened; None once the group is closing."""
        event = anyio.Event()
        with self._lock:
            if self.died is None and not self.workers.closing:
                self._waiters.append((asyncio.get_running_loop(), event))
            else:
                event.set()
        await event.wait()
        return self.died

    async def abandon(self, device: Any) -> None:
        """After a failure: kill the workers (a collective stuck on them then fails), then
        give the device's thread a few seconds to end; it is a daemon thread either way."""
        self.closed = True
        self.workers.close(kill=True)
        thread = device.close()
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join, STOP_TIMEOUT_S)
        await anyio.to_thread.run_sync(self.workers.join, 1.0)

    def shutdown(self, runner: Any) -> None:
        """Stop the workers with a stop message (no step may be running), or kill them."""
        if self.closed:
            return
        self.closed = True
        clean = self.workers.dead() is None
        if clean:
            try:
                self.workers.while_alive(runner.send_stop, "stopping")
            except Exception as e:
                logger.warning("tensor parallel: the workers did not take the stop: %s", e)
                clean = False
        self.workers.close(kill=not clean)
        self.workers.join()
        _leave_group()


def _leave_group() -> None:
    """Destroy this process's groups, so that a later engine of the process can start one
    (one tensor-parallel engine at a time per process)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start_tensor_parallel(config: EngineConfig, device_type: str) -> TensorParallel:
    """Spawn this node's workers and join the group as rank 0 (blocks until all joined)."""
    pc = config.parallel
    if config.plugins.kv_connector:
        raise ValueError("--kv-connector cannot be combined with --tensor-parallel-size > 1 "
                         "(yet): each rank holds only its heads' KV blocks")
    n = pc.tensor_parallel_size
    local = n // pc.nnodes
    init_method = pc.distributed_init_method or free_init_method()
    workers = WorkerGroup(config, list(range(1, local)), n, init_method,
                          threads_per_rank(config))
    try:
        tp = workers.while_alive(lambda: init_distributed(0, n, init_method, device_type),
                                 "joining the tensor-parallel group")
    except BaseException:
        workers.close(kill=True)
        workers.join(1.0)
        _leave_group()
        raise
    parallel = TensorParallel(tp, workers)
    parallel.watch()
    return parallel


def serve_worker_node(config: EngineConfig) -> int:
    """A node other than 0: run its worker ranks until they exit; the worst exit status."""
    pc = config.parallel
    local = pc.tensor_parallel_size // pc.nnodes
    first = pc.node_rank * local
    workers = WorkerGroup(config, list(range(first, first + local)), pc.tensor_parallel_size,
                          pc.distributed_init_method, threads_per_rank(config))
    try:
        for p in workers.procs:
            p.join()
    except KeyboardInterrupt:
        workers.close(kill=True)
    workers.join(1.0)
    return max(p.exitcode or 0 for p in workers.procs)
