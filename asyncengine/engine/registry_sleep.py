"""Sleep and wake for the registry's models (vLLM's ``/sleep`` and ``/wake_up``, and
llama-server's ``--sleep-idle-seconds``): a mixin of ``ModelRegistry`` (``registry.py``).

Level 1 keeps the engine and its weights and frees the KV cache (``sleep.py``); waking
allocates the cache again. Level 2 drops the engine as an unload does; waking loads it again
from its files. A model that cannot sleep at level 1 (blocks still in use, a device that
keeps its cache's addresses) sleeps at level 2.
"""

from __future__ import annotations

import logging
import time

import anyio

from asyncengine.engine.model_entry import ModelEntry, ModelStatus
from asyncengine.engine.sleep import KVSleep, engine_bytes, return_memory

logger = logging.getLogger("asyncengine.models")


class SleepingModels:
    """``sleep``, ``wake`` and the idle watcher, over the registry's transitions (``resolve``,
    ``_settle``, ``_transition``, ``_finish_first``, ``_stop_engine``, ``_forget``,
    ``_load``)."""

    async def sleep(self, name: str, level: int) -> ModelEntry:
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        entry = self.resolve(name)
        await self._settle(entry)
        if entry.status == ModelStatus.LOADED:
            await self._transition(entry, "sleeping", lambda e: self._sleep(e, level))
        elif entry.status == ModelStatus.SLEEPING and level > entry.sleep_level:
            await self._transition(entry, "sleeping", lambda e: self._sleep(e, level))
        return entry

    async def wake(self, name: str) -> ModelEntry:
        entry = self.resolve(name)
        await self._settle(entry)
        if entry.status == ModelStatus.SLEEPING:
            await self._transition(entry, "waking", self._wake)
        return entry

    async def _sleep(self, entry: ModelEntry, level: int) -> None:
        engine = entry.engine
        if level == 2 or engine is None or not KVSleep.possible(engine) or \
                engine.error is not None:
            # The weights go too: reloaded from file on wake.
            del engine  # (freed as _forget drops it: cycles.py)
            await self._stop_engine(entry, "put to sleep")
            self._forget(entry, ModelStatus.SLEEPING)
            entry.sleep_level = 2
            self._notify()
            return
        await self._finish_first(entry, "put to sleep")
        entry._kv = KVSleep.release(engine)
        if entry._kv is None:  # blocks still in use: the weights go too (level 2)
            await self._sleep(entry, 2)
            return
        entry.status, entry.sleep_level = ModelStatus.SLEEPING, 1
        entry.memory = engine_bytes(engine)
        return_memory()

    async def _wake(self, entry: ModelEntry) -> None:
        if entry.sleep_level == 1 and entry.engine is not None and entry._kv is not None:
            kv, entry._kv = entry._kv, None
            await anyio.to_thread.run_sync(kv.restore, entry.engine)
            entry.status, entry.sleep_level = ModelStatus.LOADED, 0
            entry.memory = engine_bytes(entry.engine)
            return
        entry.status, entry.sleep_level = ModelStatus.UNLOADED, 0
        await self._load(entry)

    async def _sleep_idle(self) -> None:
        """llama-server's --sleep-idle-seconds: a model idle that long sleeps (level 1)."""
        assert self.sleep_idle_s
        period = min(self.sleep_idle_s / 4, 1.0)
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                if entry.status == ModelStatus.LOADED and entry.busy is None and \
                        not entry.leases and now - entry.last_used >= self.sleep_idle_s and \
                        not entry.engine.outputs.streams:
                    logger.info("model %s idle for %.0fs: sleeping", entry.name,
                                now - entry.last_used)
                    await self.sleep(entry.name, 1)

