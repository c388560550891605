"""The built-in schedulers, registered by name like third-party ones."""

from __future__ import annotations

from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.core.sched.priority import PriorityScheduler

BUILTIN_SCHEDULERS = {"fcfs": FCFSScheduler, "priority": PriorityScheduler}

__all__ = ["BUILTIN_SCHEDULERS", "FCFSScheduler", "PriorityScheduler"]
