"""The event loop's thread yields its wakeups to the CPU device's compute threads.

On the CPU device the forward pass runs on the same cores as the event loop. Each step ends
with the device's worker waking the loop (``call_soon_threadsafe``); Linux's scheduler lets a
woken thread preempt the one that woke it, so the worker, which already has the next step
queued, sat out the loop's whole emission on a busy 2-core machine: the device waited 18-22%
of the run at 256 streams (``asyncengine bench overhead``, tiny runner). As ``SCHED_BATCH``
the loop's thread keeps its fair share of the cores but does not preempt on wakeup, and the
device waited 2-4%. The worker thread sets itself back to ``SCHED_OTHER`` (threads inherit
their creator's policy). Linux only; ``ASYNCENGINE_LOOP_SCHED_BATCH=0`` turns it off.
"""

from __future__ import annotations

import logging
import os

from asyncengine.config import environment

logger = logging.getLogger("asyncengine")


def _available() -> bool:
    return hasattr(os, "SCHED_BATCH") and environment.on("ASYNCENGINE_LOOP_SCHED_BATCH")


class BatchScheduled:
    """While entered, the calling thread runs as ``SCHED_BATCH``; its policy is restored on
    exit. Does nothing where the platform cannot (or when turned off)."""

    def __init__(self) -> None:
        self._saved: tuple[int, os.sched_param] | None = None

    def __enter__(self) -> BatchScheduled:
        if not _available():
            return self
        try:
            saved = os.sched_getscheduler(0), os.sched_getparam(0)
            if saved[0] == os.SCHED_OTHER:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                self._saved = saved
        except OSError as e:
            logger.debug("the loop's thread keeps its scheduling policy: %s", e)
        return self

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
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
