"""An engine freed by reference counting alone, the moment its last reference goes.

A router unloads a model while the others stream; a full ``gc.collect()`` to free the
unloaded engine's cycles walks every object of the process and stalls the other models'
steps for 0.2-0.5 s. So an engine is kept out of reference cycles, and its weights and KV
cache go when the registry drops it:

* **Cancelled tasks.** A task cancelled by its task group ends with a ``CancelledError``
  whose traceback keeps the frames it passed through, and their locals (``self``: the
  engine). asyncio and anyio put that exception in a cycle (anyio's ``task_done`` frame holds
  the error whose traceback holds that frame), so those frames live until a collection.
  :func:`task` runs a coroutine function as a task and, when it is cancelled, clears the
  frames' locals before the error leaves it. Every long-lived task that holds an engine
  (its step loop, its aborts' reaper, the registry's watchers) runs through it.
* **Back references.** The step loop and the aborts point back at their engine, and a
  failure's traceback holds the frames that raised it. :func:`dispose` breaks these edges
  once the engine's last ``async with`` block is over (the registry and ``LLMs`` call it
  when they drop an engine); the engine cannot run again afterwards.

:func:`freed` (the registry's check) watches, with a weak reference, that a dropped engine is
gone; when something still holds it after a grace period, one full collection frees it (the
fallback) and a warning says so, naming what held it, so that the cycle can be found and
broken here. ``LLMs.unload`` (offline) still needs that collection, logged at INFO: the
event loop ``anyio.run`` made for the LLM's last ``generate`` leaves frames in cycles (anyio's
cancelled tasks), and their ``f_back`` chain reaches up to ``generate``'s frame and its
``self``; only a loop on another thread, or one that outlives the calls, would avoid it.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

logger = logging.getLogger("asyncengine.models")


async def task(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """``await fn(*args)``; when cancelled, the frames the cancellation went through drop
    their locals (see the module), and so does this one."""
    try:
        await fn(*args)
    except BaseException as e:
        if isinstance(e, anyio.get_cancelled_exc_class()):
            fn = args = None  # type: ignore[assignment]  (this frame stays in the traceback)
            clear_frames(e)
        raise


def clear_frames(error: BaseException | None) -> None:
    """Drop the locals of the finished frames of ``error``'s traceback and of the
    exceptions it chains (the running frame is left alone: it raises RuntimeError)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def dispose(engine: Any) -> None:
    """Break the edges that point back at ``engine`` from the objects it owns (after its
    last ``async with`` block: it cannot run steps afterwards)."""
    loop = getattr(engine, "loop", None)
    if loop is not None:
        loop.engine = loop.drafting = None
    aborts = getattr(engine, "aborts", None)
    if aborts is not None:
        aborts.engine = None
    clear_frames(getattr(engine, "_dead", None))
    engine.emit_listeners = []


def free(ref: weakref.ref, what: str, level: int = logging.WARNING) -> bool:
    """After the last reference to an engine is dropped: True when it is gone. Otherwise one
    full collection (the fallback), logged (at ``level``) with what still held it."""
    engine = ref()
    if engine is None:
        return True
    holders = ", ".join(dict.fromkeys(_describe(r) for r in gc.get_referrers(engine)))
    del engine
    started = time.perf_counter()
    gc.collect()
    logger.log(level, "%s: the engine was still referenced after it was dropped (by %s): a "
               "full garbage collection freed it in %.2fs", what, holders or "a cycle",
               time.perf_counter() - started)
    return ref() is None


async def freed(ref: weakref.ref, what: str, grace_s: float = 2.0) -> bool:
    """:func:`free`, after up to ``grace_s`` seconds for what still holds the engine to let
    go by itself (a request's handler that has just ended, its response being finished)."""
    with anyio.move_on_after(grace_s):
        while ref() is not None:
            await anyio.sleep(0.02)
    return free(ref, what)


def _describe(obj: Any) -> str:
    code = getattr(obj, "f_code", None)
    if code is not None:
        return f"frame {code.co_name} ({code.co_filename.rsplit('/', 1)[-1]})"
    return type(obj).__qualname__
