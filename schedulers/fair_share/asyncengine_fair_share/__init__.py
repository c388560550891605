"""Weighted fair share between tenants: an asyncengine scheduler plugin (``--scheduler
fair-share``)."""

from __future__ import annotations

from asyncengine_fair_share.scheduler import FairShareQueue, FairShareScheduler, parse_weights

__all__ = ["FairShareQueue", "FairShareScheduler", "parse_weights"]
