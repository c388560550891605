"""A shortest-prompt-first scheduler for asyncengine, packaged as a plugin."""

from __future__ import annotations

from asyncengine_spf.scheduler import ShortestPromptFirstScheduler

__all__ = ["ShortestPromptFirstScheduler"]
