"""The plugin module named by the entry point: asyncengine calls its hooks."""

from __future__ import annotations

from asyncengine.plugins import Register, hookimpl
from asyncengine_spf.scheduler import ShortestPromptFirstScheduler


@hookimpl
def register_schedulers(register: Register) -> None:
    register("spf", ShortestPromptFirstScheduler)
