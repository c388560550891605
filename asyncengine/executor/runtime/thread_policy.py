"""The event loop's thread yields its wakeups to the CPU device's compute threads.

On the CPU device the forward pass runs on the same cores as the event loop. Each step ends
with the device's worker waking the loop (``call_soon_threadsafe``); Linux's scheduler lets a
woken thread preempt the one that woke it, so the worker, which already has the next step
queued, sat out the loop's whole emission on a busy 2-core machine: the device waited 18-22%
of the run at 256 streams (``asyncengine bench overhead``, tiny runner). As ``SCHED_BATCH``
the loop's thread keeps its fair share of the cores but does not preempt on wakeup, and the
device waited 2-4%. The worker thread sets itself back to ``SCHED_OTHER`` (threads inherit
their creator's policy). Linux only; ``ASYNCENGINE_LOOP_SCHED_BATCH=0`` turns it off.

A thread's policy is one per thread, and a router runs several engines on one loop thread:
the first engine entered sets ``SCHED_BATCH``, the last one to leave restores the policy it
found (a count per thread), so an unloaded model never takes it from the others.
"""

from __future__ import annotations

import logging
import os
import threading

from asyncengine.config import environment

logger = logging.getLogger("asyncengine")


def _available() -> bool:
    return hasattr(os, "SCHED_BATCH") and environment.on("ASYNCENGINE_LOOP_SCHED_BATCH")


#: Per thread id: how many ``BatchScheduled`` hold it, and the policy to restore (None: it
#: was not ``SCHED_OTHER``, or could not be changed).
_HELD: dict[int, tuple[int, tuple[int, os.sched_param] | None]] = {}


class BatchScheduled:
    """While entered, the calling thread runs as ``SCHED_BATCH``; its policy is restored when
    the last one entered on that thread exits (see the module). Does nothing where the
    platform cannot (or when turned off)."""

    def __init__(self) -> None:
        self._thread: int | None = None  # the thread it was entered on

    def __enter__(self) -> BatchScheduled:
        if not _available() or self._thread is not None:
            return self
        self._thread = thread = threading.get_ident()
        held = _HELD.get(thread)
        if held is not None:
            _HELD[thread] = (held[0] + 1, held[1])
            return self
        saved = None
        try:
            policy = os.sched_getscheduler(0), os.sched_getparam(0)
            if policy[0] == os.SCHED_OTHER:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                saved = policy
        except OSError as e:
            logger.debug("the loop's thread keeps its scheduling policy: %s", e)
        _HELD[thread] = (1, saved)
        return self

    def __exit__(self, *exc: object) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        count, saved = _HELD.pop(thread)
        if count > 1:
            _HELD[thread] = (count - 1, saved)
        elif saved is not None:
            try:
                os.sched_setscheduler(0, *saved)
            except OSError:
                pass


def as_compute_thread() -> None:
    """In a compute thread the loop's thread created: the ordinary policy, so that it is not
    ``SCHED_BATCH`` by inheritance."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
