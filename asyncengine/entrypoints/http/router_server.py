"""``asyncengine serve --models-dir DIR`` (or ``--enable-sleep-mode``): the router server.

One event loop, one aiohttp server, one registry of engines (``engine/registry.py``): each
model is an engine whose step loop is a task of the registry's task group, loaded on its first
request. A model whose engine fails ends alone (it shows ``failed``, a later request may load
it again); the server lives on. SIGINT/SIGTERM drain every engine as ``serve`` drains one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import ssl
from collections.abc import Callable
from typing import Any

import anyio

from asyncengine.config import EngineConfig
from asyncengine.config.models_preset import load_presets
from asyncengine.engine.catalog import ModelSource, build_catalog, engine_config
from asyncengine.engine.gc_policy import tune_for_serving
from asyncengine.engine.model_entry import adapter_names
from asyncengine.entrypoints.flags.router import RouterSettings
from asyncengine.entrypoints.http.listen import listening
from asyncengine.entrypoints.http.state import STATE, ServerSettings

logger = logging.getLogger("asyncengine.entrypoints.http")



def catalog(config: EngineConfig, rs: RouterSettings) -> list[ModelSource]:
    """The models to serve: the directory's (and the presets'), else the one model of the
    command line (sleep mode on a one-model server). Every preset's options are checked now
    (a ValueError naming the flag), not at the model's first request."""
    presets = load_presets(rs.models_preset) if rs.models_preset else {}
    if rs.models_dir or presets:
        sources = build_catalog(rs.models_dir, presets, embedded=True)
        if len(sources) == 1:
            logger.warning("--models-dir: no models in %s (.gguf files, or directories with "
                           "config.json or a .gguf file): serving the embedded one alone",
                           rs.models_dir)
    else:
        from asyncengine.executor.weights.loader import EMBEDDED_NAME

        mc = config.model
        names = list(mc.served_model_name or [mc.model or EMBEDDED_NAME])
        sources = [ModelSource(names[0], mc.model, names[1:])]
    for source in sources:
        try:
            engine_config(config, source)
        except ValueError as e:
            raise ValueError(f"--models-preset: [{source.name}]: {e}") from None
    # A request names an adapter as it names a model: each name belongs to one model.
    owners = {n: s.name for s in sources for n in s.names}
    for source in sources:
        for adapter in adapter_names(source):
            if adapter in owners:
                raise ValueError(f"--models-preset: [{source.name}]: the LoRA adapter name "
                                 f"{adapter!r} is taken by [{owners[adapter]}] (a request's "
                                 "model names one model or adapter: rename one)")
            owners[adapter] = source.name
    return sources


def engine_factory(base: EngineConfig, make_metrics: Callable[[Any], Any]) -> Any:
    """Builds a model's engine (called off the loop, in a thread)."""

    def make(source: ModelSource) -> Any:
        from asyncengine.engine.engine import AsyncEngine

        engine = AsyncEngine(engine_config(base, source))
        engine.metrics = make_metrics(engine)
        return engine

    return make


async def serve_router(config: EngineConfig, settings: ServerSettings, rs: RouterSettings,
                       sources: list[ModelSource], tls: ssl.SSLContext | None,
                       make_metrics: Callable[[Any], Any]) -> int:
    """Serve until SIGINT/SIGTERM (``server.main`` passes the TLS context and how each
    engine's metrics are made, as ``serve`` makes them)."""
    from asyncengine.engine.registry import ModelRegistry
    from asyncengine.entrypoints.batch.service import batch_jobs
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.executor.runtime.cpu_malloc import limit_arenas

    limit_arenas()  # loads and unloads in new threads: a few arenas, not 8 a core

    registry = ModelRegistry(sources, engine_factory(config, make_metrics),
                             max_models=rs.models_max,
                             autoload=rs.autoload, memory_budget=rs.memory_budget,
                             drain_timeout=settings.shutdown_timeout
                             if rs.unload_timeout is None else rs.unload_timeout,
                             sleep_idle_s=rs.sleep_idle_s)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with registry, contextlib.AsyncExitStack() as jobs:
            app = build_app(None, None, settings, registry=registry)
            # The Batch API: each line runs on its model's engine (loaded on demand); the
            # batches' tasks are cancelled after the drain, as ``serve`` cancels them.
            await jobs.enter_async_context(batch_jobs(app, config.scheduler.max_num_seqs))
            async with listening(app, settings, tls) as runner:
                if runner is None:
                    return 1
                try:
                    for address in runner.addresses:
                        logger.info("serving %d model(s) (%s) on %s://%s:%s%s", len(sources),
                                    ", ".join(s.name for s in sources), "https" if tls else "http",
                                    address[0], address[1], settings.root_path)
                    # What start-up made (modules, the app) is never garbage: frozen, a full
                    # collection walks only what came later, and collections come less often,
                    # as a single-model server has them (engine/gc_policy.py). Never after a
                    # load: a frozen engine would never be freed. (An unloaded engine is freed
                    # by reference counting, with no collection: engine/cycles.py.)
                    tune_for_serving()
                    for source in sources:
                        if source.load_on_startup and rs.autoload:
                            try:
                                await registry.load(source.name)
                            except Exception as e:  # it shows failed; the others serve
                                logger.error("load-on-startup: %s", e)
                    async for signum in signals:
                        logger.info("%s received", signal.Signals(signum).name)
                        break
                    app[STATE].draining = True
                    logger.info("draining (up to %ss)", settings.shutdown_timeout)
                    with anyio.move_on_after(settings.shutdown_timeout + 1):
                        async with anyio.create_task_group() as tg:

                            async def second_signal() -> None:
                                async for _ in signals:
                                    tg.cancel_scope.cancel()
                                    return

                            tg.start_soon(second_signal)
                            await registry.drain(settings.shutdown_timeout)
                            tg.cancel_scope.cancel()
                    await registry.drain(0)
                finally:
                    gc.unfreeze()
    logger.info("stopped")
    return 0
