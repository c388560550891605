"""The module the entry point names: asyncengine calls its hooks."""

from __future__ import annotations

from asyncengine.plugins import Register, hookimpl
from asyncengine_fair_share.scheduler import FairShareScheduler


@hookimpl
def register_schedulers(register: Register) -> None:
    register("fair-share", FairShareScheduler)
