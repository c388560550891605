"""Several engines in one event loop: loaded on demand, unloaded least recently used first,
put to sleep and woken.

Each loaded model is an ``AsyncEngine`` whose step loop is a task of the registry's task
group (``_host`` enters the engine and keeps it entered until it is unloaded or fails). Its
weights are built off the loop, in a thread, so a load never stalls the other models' steps
or the HTTP handlers.

Callers take an engine for the length of a request with ``async with registry.use(name)``: a
lease. A model that is not loaded is loaded then (unless ``autoload`` is off); requests that
arrive meanwhile wait for that model alone. Each model has at most one transition (load,
unload, sleep, wake) running at a time: ``busy`` is checked and set without an ``await`` in
between, so on one loop no lock is needed, and two requests for a model that is loading wait
for the same load.

An unload (or a sleep) finishes first: the model takes no new leases, waits up to
``drain_timeout`` for its leases to end, aborts what is left, then leaves its engine; the
weights and the KV cache go with the engine's last reference. Room for a load is made before
it starts: by count (``max_models``, loaded + loading + asleep at level 1) and by the memory
estimate (``memory_budget``, bytes), unloading the least recently used idle models first.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from asyncengine.engine.catalog import ModelSource
from asyncengine.engine.cycles import dispose, free, freed, task
from asyncengine.engine.model_entry import (
    ModelEntry,
    ModelNotFound,
    ModelStatus,
    ModelUnavailable,
    adapter_names,
    reason,
    where,
)
from asyncengine.engine.registry_sleep import SleepingModels
from asyncengine.engine.sleep import engine_bytes, return_memory

__all__ = ["ModelEntry", "ModelNotFound", "ModelRegistry", "ModelStatus", "ModelUnavailable"]

logger = logging.getLogger("asyncengine.models")


MakeEngine = Callable[[ModelSource], Any]


class ModelRegistry(SleepingModels):
    """The models of one server, by name and alias (see the module's docstring)."""

    def __init__(self, sources: list[ModelSource], make_engine: MakeEngine, *,
                 max_models: int = 4, autoload: bool = True, memory_budget: int | None = None,
                 drain_timeout: float = 30.0, sleep_idle_s: float | None = None) -> None:
        if not sources:
            raise ValueError("--models-dir: no models found (.gguf files, or directories with "
                             "config.json or a .gguf file)")
        self.entries = {s.name: ModelEntry(s) for s in sources}
        self._by_name = {n: e for e in self.entries.values() for n in e.source.names}
        # LoRA adapters of a model's preset (--lora-modules): a request naming one goes to
        # that model, which serves it as its adapter.
        self._adapters = {a: e for e in self.entries.values() for a in adapter_names(e.source)}
        self.make_engine = make_engine
        self.max_models = max_models  # 0: no limit (llama-server's meaning)
        self.autoload = autoload
        self.memory_budget = memory_budget
        self.drain_timeout = drain_timeout
        self.sleep_idle_s = sleep_idle_s
        #: Called with each engine once it runs (the server attaches its sender).
        self.on_loaded: list[Callable[[Any], None]] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed = anyio.Event()

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> ModelRegistry:
        self._changed = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.sleep_idle_s:
            self._tg.start_soon(self._sleep_idle)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None
        with anyio.CancelScope(shield=True):
            for entry in list(self.entries.values()):
                if entry.engine is not None:
                    entry.engine.aborts.all()
                if entry._stop is not None:
                    entry._stop.set()
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc_info)
        finally:
            self._tg = None
            for entry in self.entries.values():  # (at exit: no check that each is freed)
                self._forget(entry, entry.status if entry.status == ModelStatus.FAILED
                             else ModelStatus.UNLOADED, check=False)

    async def drain(self, timeout: float) -> None:
        """Shutdown: every engine stops accepting; in-flight requests get ``timeout``."""
        async with anyio.create_task_group() as tg:
            for entry in self.entries.values():
                if entry.engine is not None:
                    tg.start_soon(entry.engine.drain, timeout)

    def add(self, source: ModelSource) -> ModelEntry:
        """A model found after start-up (``POST /models/load`` of a path in the directory)."""
        taken = [n for n in source.names if n in self._by_name]
        if taken:
            raise ValueError(f"the name {taken[0]!r} is taken")
        entry = self.entries[source.name] = ModelEntry(source)
        for n in source.names:
            self._by_name[n] = entry
        return entry

    # -- lookups --------------------------------------------------------------------------------
    def resolve(self, name: str) -> ModelEntry:
        entry = self._by_name.get(name) or self._adapters.get(name)
        if entry is None:
            raise ModelNotFound(name, [*self.names(), *self._adapters])
        return entry

    def adapters_of(self, entry: ModelEntry) -> list[str]:
        return [a for a, e in self._adapters.items() if e is entry]

    def names(self) -> list[str]:
        return [n for e in self.entries.values() for n in e.source.names]

    # -- leases ---------------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[Any]:
        """The model's engine for the length of the block: loaded (or woken) first when it
        needs to be; it is not unloaded before the block ends."""
        entry = self.resolve(name)
        engine = await self.ready(entry)
        entry.leases += 1
        entry.last_used = time.monotonic()
        try:
            yield engine
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            if entry.leases == 0:
                entry._idle.set()
                entry._idle = anyio.Event()

    async def ready(self, entry: ModelEntry, *, load: bool = False) -> Any:
        """The entry's running engine, after loading or waking it when needed (``load``: even
        with autoload off, as ``POST /models/load`` does)."""
        while True:
            if entry.busy is None:
                if entry.status == ModelStatus.LOADED:
                    return entry.engine
                if entry.status == ModelStatus.SLEEPING:
                    await self._transition(entry, "waking", self._wake)
                elif not (self.autoload or load):
                    raise ModelUnavailable(
                        f"The model `{entry.name}` is not loaded (this server does not load "
                        "models on demand: POST /models/load first).", status=400)
                else:
                    await self._transition(entry, "loading", self._load)
            else:
                await entry._settled.wait()
            if entry.busy is None and entry.status == ModelStatus.FAILED:
                raise entry.load_failure()

    # -- explicit transitions (POST /models/load, /models/unload, /sleep, /wake_up) -------------
    async def load(self, name: str) -> ModelEntry:
        entry = self.resolve(name)
        await self.ready(entry, load=True)
        return entry

    async def _settle(self, entry: ModelEntry) -> None:
        while entry.busy is not None:
            await entry._settled.wait()

    async def unload(self, name: str) -> ModelEntry:
        entry = self.resolve(name)
        await self._settle(entry)
        if entry.engine is not None or entry.status == ModelStatus.SLEEPING:
            await self._transition(entry, "unloading", self._unload)
        return entry

    # -- the transitions ------------------------------------------------------------------------
    async def _transition(self, entry: ModelEntry, what: str,
                          fn: Callable[[ModelEntry], Awaitable[None]]) -> None:
        """Run ``fn(entry)`` as the entry's one transition, in the registry's task group: the
        request that started it may go (its client left, its handler is cancelled), and the
        load goes on for the requests waiting for it; the entry never stays half changed."""
        assert self._tg is not None, "use the registry inside `async with registry`"
        entry.busy = what
        settled = entry._settled

        async def run() -> None:
            try:
                await fn(entry)
            except Exception as e:  # a bug or a device error: this model alone fails
                logger.exception("model %s: %s failed", entry.name, what)
                entry.status, entry.error = ModelStatus.FAILED, reason(entry, e)
            finally:
                entry.busy = None
                entry._settled = anyio.Event()
                settled.set()
                self._notify()

        self._tg.start_soon(run)
        await settled.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _load(self, entry: ModelEntry) -> None:
        estimate = entry.source.weight_bytes()
        if self.memory_budget is not None and estimate > self.memory_budget:
            entry.status, entry.error = ModelStatus.FAILED, (
                f"{where(entry)} needs about {estimate >> 20} MiB for its weights alone, more "
                f"than --models-memory ({self.memory_budget >> 20} MiB)")
            return
        await self._make_room(entry, estimate)
        entry.status, entry.error, entry.memory = ModelStatus.LOADING, None, estimate
        started = time.perf_counter()
        try:
            engine = await anyio.to_thread.run_sync(self.make_engine, entry.source)
            await self._start(entry, engine)
        except Exception as e:  # a broken file, a bad option: this model alone fails
            logger.warning("model %s failed to load: %s", entry.name, e)
            entry.status, entry.error, entry.memory = ModelStatus.FAILED, reason(entry, e), 0
            return_memory()
            return
        entry.memory = engine_bytes(engine)
        logger.info("model %s loaded in %.2fs (%d MiB)", entry.name,
                    time.perf_counter() - started, entry.memory >> 20)

    async def _start(self, entry: ModelEntry, engine: Any) -> None:
        assert self._tg is not None, "use the registry inside `async with registry`"
        entry._stop, entry._host_done = anyio.Event(), anyio.Event()
        await self._tg.start(self._host, entry, engine)
        entry.engine, entry.status, entry.sleep_level = engine, ModelStatus.LOADED, 0
        for hook in self.on_loaded:
            hook(engine)

    async def _host(self, entry: ModelEntry, engine: Any, *,
                    task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The engine's life: entered here, so its step loop is a task of this graph."""
        stop, done = entry._stop, entry._host_done
        assert stop is not None and done is not None
        try:
            async with engine:
                task_status.started()
                async with anyio.create_task_group() as tg:  # (no closures: cycles.py)
                    tg.start_soon(task, self._on_failure, entry, engine, tg.cancel_scope)
                    tg.start_soon(task, _cancel_when, stop, tg.cancel_scope)
        finally:
            done.set()
            if entry.status == ModelStatus.FAILED and entry.engine is engine:
                self._forget(entry, ModelStatus.FAILED)
                self._notify()

    @staticmethod
    async def _on_failure(entry: ModelEntry, engine: Any, scope: anyio.CancelScope) -> None:
        failure = await engine.wait_failed()
        entry.status, entry.error = ModelStatus.FAILED, f"the engine failed: {failure}"
        logger.error("model %s failed: %s", entry.name, failure)
        scope.cancel()

    async def _finish_first(self, entry: ModelEntry, why: str = "unloaded") -> None:
        """No new leases (the entry is busy); the leases end or time out, the rest is
        aborted (their callers are told the model was ``why``: unloaded, put to sleep); then
        the engine's requests are all gone (an abort is reaped a step later)."""
        engine = entry.engine
        if engine is None:
            return
        with anyio.move_on_after(self.drain_timeout):
            while entry.leases:
                await entry._idle.wait()
        if entry.leases:
            logger.warning("model %s: aborting %d request(s) still running after %.0fs",
                           entry.name, entry.leases, self.drain_timeout)
            engine.aborts.all(f"The request was aborted: the model `{entry.name}` was {why} "
                              "(POST /models/load, or a request naming it, loads it again).")
        with anyio.move_on_after(5):
            while entry.leases or engine.num_unfinished_requests:
                await anyio.sleep(0.01)
        engine.aborts.reason = None  # (their handlers have answered)

    async def _stop_engine(self, entry: ModelEntry, why: str = "unloaded") -> None:
        """Finish first, then the engine is left and dropped."""
        await self._finish_first(entry, why)
        if entry._stop is not None:
            entry._stop.set()
        if entry._host_done is not None:
            await entry._host_done.wait()

    async def _unload(self, entry: ModelEntry) -> None:
        started = time.perf_counter()
        await self._stop_engine(entry)
        self._forget(entry, ModelStatus.UNLOADED)
        logger.info("model %s unloaded in %.2fs", entry.name, time.perf_counter() - started)

    def _forget(self, entry: ModelEntry, status: ModelStatus, check: bool = True) -> None:
        """Drop the entry's engine: reference counting frees it, its weights and its KV
        cache at once (``cycles.py``; a full collection only if something still holds it)."""
        engine = entry.engine
        had = engine is not None or entry._kv is not None
        entry.engine = entry._stop = entry._host_done = entry._kv = None
        entry.extras.clear()
        entry.status, entry.sleep_level, entry.memory = status, 0, 0
        if engine is not None and check:
            ref = weakref.ref(engine)
            dispose(engine)
            del engine
            if ref() is not None and self._tg is not None:  # a handler ending holds it yet
                self._tg.start_soon(self._freed, ref, entry.name)
                return
            free(ref, f"model {entry.name}")
        if had:
            return_memory()

    @staticmethod
    async def _freed(ref: weakref.ref, name: str) -> None:
        await freed(ref, f"model {name}")
        return_memory()

    async def _make_room(self, entry: ModelEntry, estimate: int) -> None:
        """Unload least recently used models until ``entry`` fits by count and memory."""
        while True:
            others = [e for e in self.entries.values() if e is not entry and e.resident]
            over_count = self.max_models > 0 and len(others) >= self.max_models
            used = sum(e.memory for e in others)
            over_memory = self.memory_budget is not None and used + estimate > \
                self.memory_budget
            if not (over_count or over_memory):
                return
            victims = sorted((e for e in others if e.busy is None),
                             key=lambda e: (e.leases > 0, e.last_used))
            if victims:
                victim = victims[0]
                logger.info("unloading %s to make room for %s (%s)", victim.name, entry.name,
                            "--models-max" if over_count else "--models-memory")
                await self._transition(victim, "unloading", self._unload)
            else:
                await self._changed.wait()


async def _cancel_when(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
