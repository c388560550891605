"""KVTransfer: the engine's side of a KV connector — load before a step, save after it.

Per step, on the event loop::

    out = scheduler.schedule()            # admissions carry ScheduledRequest.kv_load
    await transfer.load(out)              # fill those blocks; a block not loaded is recomputed
    ... forward pass ...
    scheduler.update_from_output(out, result)
    transfer.save(tg, out)                # copy the step's new full blocks, write them later

Saving copies the blocks on the loop before the next step is scheduled (a block may be reused
by any later step), then the connector writes in the background, off the loop. Copies not yet
written are capped (``MAX_PENDING_SAVE_BYTES``): past it, a step's blocks are not saved, so a
slow store costs cache hits, never memory or latency.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc
import anyio.to_thread

from asyncengine.core.kv.hashing import update_block_hashes

if TYPE_CHECKING:
    import torch

    from asyncengine.core.sched.interface import KVLoad, ScheduledRequest, SchedulerOutput
    from asyncengine.ext.contracts.kv_connector import KVConnector

logger = logging.getLogger("asyncengine")

MAX_PENDING_SAVE_BYTES = 1 << 30


class PendingBlocks(Protocol):
    """Blocks still being copied (CUDA: a side-stream copy, ``executor/kv/blocks.py``):
    ``wait()`` blocks until the copy is done and returns them; call it off the loop."""

    def wait(self) -> torch.Tensor: ...


class KVBlockIO(Protocol):
    """What the transfer needs of the model runner: the per-layer caches and whole-block
    copies (``asyncengine.executor.runner.ModelRunner`` provides them)."""

    kv_caches: list[torch.Tensor]

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor | PendingBlocks: ...

    def write_kv_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


class KVTransfer:
    def __init__(self, connector: KVConnector, runner: KVBlockIO, block_size: int) -> None:
        self.connector = connector
        self.runner = runner
        self.block_size = block_size
        self._block_bytes = sum(c.numel() // c.shape[1] * c.element_size()
                                for c in runner.kv_caches)  # [2, num_blocks, ...] per layer
        self._write_limiter = anyio.CapacityLimiter(1)  # one writer of the cache at a time
        self._pending_saves = 0
        self._pending_bytes = 0
        self._saves_done: anyio.Event | None = None
        # Cumulative counters, in tokens / blocks.
        self.num_loaded_tokens = 0
        self.num_failed_load_tokens = 0  # found by lookup, then not loadable: recomputed
        self.num_saved_blocks = 0  # handed to the connector
        self.num_unsaved_blocks = 0  # dropped: too many copies waiting to be written

    # -- before the forward pass ------------------------------------------------------------
    async def load(self, out: SchedulerOutput) -> None:
        """Fill the blocks of this step's ``kv_load``s. Where a block cannot be loaded, the
        step is widened to recompute the request from that block on."""
        loads = [s for s in out.scheduled if s.kv_load is not None]
        if not loads:
            return
        async with anyio.create_task_group() as tg:
            for s in loads:
                tg.start_soon(self._load_one, s, s.kv_load)

    async def _load_one(self, s: ScheduledRequest, load: KVLoad) -> None:
        wanted = len(load.block_ids)
        try:
            kv = await self.connector.load(load.block_hashes)
            n = min(int(kv.shape[0]), wanted)
            if n:
                await anyio.to_thread.run_sync(
                    self.runner.write_kv_blocks, load.block_ids[:n], kv[:n],
                    limiter=self._write_limiter)
        except Exception:
            logger.warning("KV connector: loading %d blocks failed; recomputing them", wanted,
                           exc_info=True)
            n = 0
        bs = self.block_size
        self.num_loaded_tokens += n * bs
        if n < wanted:
            first_missing = load.first_token + n * bs
            self.num_failed_load_tokens += s.start - first_missing
            s.num_new_tokens += s.start - first_missing
            s.start = first_missing
            s.request.num_cached_tokens = min(s.request.num_cached_tokens, first_missing)

    # -- after the step ---------------------------------------------------------------------
    def save(self, tg: anyio.abc.TaskGroup, out: SchedulerOutput) -> None:
        """Copy the full blocks this step completed and save them in the background. Call on
        the loop right after the step, before the next ``schedule()``."""
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[bytes] = []
        seen: set[bytes] = set()
        for s in out.scheduled:
            first, end = s.start // bs, (s.start + s.num_new_tokens) // bs
            if end <= first:
                continue
            all_hashes = update_block_hashes(s.request, bs)
            for i in range(first, end):
                if all_hashes[i] not in seen:  # two requests computed the same block
                    seen.add(all_hashes[i])
                    block_ids.append(s.block_ids[i])
                    hashes.append(all_hashes[i])
        if not block_ids:
            return
        nbytes = len(block_ids) * self._block_bytes
        if self._pending_bytes + nbytes > MAX_PENDING_SAVE_BYTES:
            self.num_unsaved_blocks += len(block_ids)
            logger.debug("KV connector: %d blocks not saved, the store is behind",
                         len(block_ids))
            return
        kv = self.runner.read_kv_blocks(block_ids)
        self._pending_saves += 1
        self._pending_bytes += nbytes
        tg.start_soon(partial(self._save, hashes, kv, nbytes))

    async def _save(self, hashes: list[bytes], kv: torch.Tensor | PendingBlocks,
                    nbytes: int) -> None:
        try:
            wait = getattr(kv, "wait", None)
            if wait is not None:  # a device copy in flight: wait for it in a thread
                kv = await anyio.to_thread.run_sync(wait)
            await self.connector.save(hashes, kv)
            self.num_saved_blocks += len(hashes)
        except Exception:
            logger.warning("KV connector: saving %d blocks failed", len(hashes), exc_info=True)
        finally:
            self._pending_saves -= 1
            self._pending_bytes -= nbytes
            if self._pending_saves == 0 and self._saves_done is not None:
                self._saves_done.set()

    async def wait_for_saves(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for the saves in flight. True if none is left."""
        with anyio.move_on_after(timeout):
            while self._pending_saves:
                self._saves_done = anyio.Event()
                await self._saves_done.wait()
        return self._pending_saves == 0
