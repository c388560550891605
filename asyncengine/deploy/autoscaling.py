"""WaitingQueuePolicy: Ray Serve autoscaling driven by the engines' waiting queues.

Each engine replica reports ``num_waiting`` (requests its scheduler could not admit yet: no
KV blocks or batch slots), ``num_running`` and ``max_num_seqs`` through Serve's
``record_autoscaling_stats`` hook; Serve averages them over ``look_back_period_s`` and calls
this policy in its controller. Serve's ongoing-request count is the wrong signal for an
engine that batches: 100 requests in flight on one replica are cheap while they all run in
one batch, and the replica is saturated only when its scheduler starts queueing them.

* Waiting requests per replica above ``target_waiting``: scale up in proportion
  (``replicas * waiting_per_replica / target_waiting``).
* No request waiting: scale down to the fewest replicas whose batch slots
  (``max_num_seqs``) hold the running requests at ``downscale_utilization``.
* Otherwise keep the count.

Serve's wrapper then applies the deployment's ``min_replicas``/``max_replicas``, scaling
factors and ``upscale_delay_s``/``downscale_delay_s`` to the decision.
"""

from __future__ import annotations

import math
from typing import Any


class WaitingQueuePolicy:
    def __init__(self, target_waiting: float = 4.0, downscale_utilization: float = 0.5) -> None:
        if target_waiting <= 0:
            raise ValueError(f"target_waiting must be positive, not {target_waiting}")
        if not 0 < downscale_utilization <= 1:
            raise ValueError("downscale_utilization must be in (0, 1], not "
                             f"{downscale_utilization}")
        self.target_waiting = target_waiting
        self.downscale_utilization = downscale_utilization

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        current = ctx.current_num_replicas
        metrics = ctx.aggregated_metrics or {}
        waiting = metrics.get("num_waiting") or {}
        if current == 0 or not waiting:  # nothing reported yet
            return ctx.target_num_replicas, {}
        return self.decide(current, sum(waiting.values()),
                           sum((metrics.get("num_running") or {}).values()),
                           _mean((metrics.get("max_num_seqs") or {}).values())), {}

    def decide(self, replicas: int, waiting: float, running: float,
               max_num_seqs: float | None) -> float:
        """The desired replica count, before Serve's bounds, factors and delays."""
        per_replica = waiting / replicas
        if per_replica > self.target_waiting:
            return replicas * per_replica / self.target_waiting
        if waiting == 0 and max_num_seqs:
            needed = math.ceil(running / (max_num_seqs * self.downscale_utilization))
            return max(1, min(replicas, needed))
        return replicas


def _mean(values: Any) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
