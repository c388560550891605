"""FairShareScheduler: the batch's request slots shared between tenants by weight.

A request's tenant is ``Request.tenant``: the HTTP server sets it from the ``X-Tenant`` header,
else from the bearer API key (``key-`` + a digest of it); ``AsyncEngine.add_request(tenant=)``
sets it directly; None is the default tenant. Weights come from the scheduler's options::

    asyncengine serve MODEL --scheduler fair-share \\
        --scheduler-config '{"weights": {"team-a": 3, "team-b": 1}, "default_weight": 1}'

A tenant's *share* is its running requests divided by its weight. The policy, on FCFS's
batching (chunked prefill, prefix caching, preemption by recompute):

* **Admission**: the next waiting request is the head (arrival order) of the waiting tenant
  with the smallest share; ties go to the earlier arrival.
* **Reclaiming slots**: when that request does not fit (``max_num_seqs`` or KV blocks), the
  newest running request of the tenant with the largest share is preempted, if that share
  exceeds what the newcomer's tenant would hold after admission. So a tenant flooding the
  server holds the batch only while nobody else asks; a tenant that arrives later gets its
  weighted part of the slots at the next step, not after the flood drains. The strict
  comparison keeps it from thrashing: two tenants at equal share never preempt each other.
* **Out of blocks while running**: the victim is the newest request of the tenant with the
  largest share (FCFS takes the newest request overall).

Preempted requests go back to the front of their tenant's queue. Per step the work is
O(tenants) per admission plus O(running) per preemption; tenant counts are kept as requests
start and stop running, never recounted.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from asyncengine.plugins import EngineConfig, FCFSQueue, FCFSScheduler, Request

Tenant = str | None


def parse_weights(options: dict[str, Any] | None) -> tuple[dict[Tenant, float], float]:
    """``(weights, default_weight)`` from ``--scheduler-config``; ValueError naming the flag."""
    options = dict(options or {})
    weights = options.pop("weights", {}) or {}
    default = options.pop("default_weight", 1)
    if options:
        raise ValueError(f"--scheduler-config: fair-share does not know {sorted(options)} "
                         "(known: weights, default_weight)")
    if not isinstance(weights, dict):
        raise ValueError("--scheduler-config: fair-share 'weights' must be an object "
                         f"{{tenant: weight}}, got {weights!r}")
    checked: dict[Tenant, float] = {}
    for tenant, w in [*weights.items(), (None, default)]:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
            what = "default_weight" if tenant is None else f"weight of {tenant!r}"
            raise ValueError(f"--scheduler-config: fair-share {what} must be a positive "
                             f"number, got {w!r}")
        checked[tenant] = float(w)
    return checked, checked.pop(None)


class _TenantCountedList(list):
    """The scheduler's running list, counting requests per tenant as they come and go."""

    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def append(self, request: Request) -> None:
        super().append(request)
        self.counts[request.tenant] += 1

    def remove(self, request: Request) -> None:
        super().remove(request)
        self.counts[request.tenant] -= 1


class FairShareQueue:
    """Waiting requests: one arrival-order queue per tenant; the next is the head of the
    tenant with the smallest share (``share(tenant)``), ties by arrival."""

    def __init__(self, share: Callable[[Tenant], float]) -> None:
        self._share = share
        self._queues: dict[Tenant, FCFSQueue] = {}
        self._arrival: dict[str, int] = {}  # request id -> arrival number (kept on preemption)
        self._counter = itertools.count()
        self._len = 0
        self._peeked: Request | None = None

    def _queue(self, tenant: Tenant) -> FCFSQueue:
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = FCFSQueue()
        return q

    def add(self, request: Request) -> None:
        self._arrival.setdefault(request.request_id, next(self._counter))
        self._queue(request.tenant).add(request)
        self._len += 1

    def add_front(self, request: Request) -> None:
        self._arrival.setdefault(request.request_id, next(self._counter))
        self._queue(request.tenant).add_front(request)
        self._len += 1

    def peek(self) -> Request:
        best: tuple[float, int] | None = None
        head: Request | None = None
        for tenant, q in self._queues.items():
            candidate = q.peek()
            key = (self._share(tenant), self._arrival[candidate.request_id])
            if best is None or key < best:
                best, head = key, candidate
        if head is None:
            raise IndexError("peek from an empty queue")
        self._peeked = head
        return head

    def pop(self) -> Request:
        # The request peek() chose, even if preemptions since then changed the shares (the
        # scheduler preempts to admit exactly that one).
        request = self._peeked
        if request is None or request not in self._queues.get(request.tenant, ()):
            request = self.peek()
        self._peeked = None
        q = self._queues[request.tenant]
        if q.peek() is not request:  # it was added back behind another: take it out anyway
            q.remove(request)
        else:
            q.pop()
        self._forget(request, q)
        return request

    def remove(self, request: Request) -> None:
        q = self._queues.get(request.tenant)
        if q is None or request not in q:
            return
        q.remove(request)
        self._forget(request, q)

    def _forget(self, request: Request, q: FCFSQueue) -> None:
        self._len -= 1
        self._arrival.pop(request.request_id, None)
        if not q:
            del self._queues[request.tenant]
        if self._peeked is request:
            self._peeked = None

    def __contains__(self, request: Request) -> bool:
        q = self._queues.get(request.tenant)
        return q is not None and request in q

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        waiting = [r for q in self._queues.values() for r in q]
        return iter(sorted(waiting, key=lambda r: self._arrival[r.request_id]))

    def tenants(self) -> list[Tenant]:
        return list(self._queues)


class FairShareScheduler(FCFSScheduler):
    """FCFS batching; slots shared between tenants by weight (see the module docstring)."""

    contract_version = 2

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.weights, self.default_weight = parse_weights(config.scheduler.scheduler_config)
        self.running_per_tenant: Counter = Counter()
        super().__init__(config, num_blocks)
        self.running = _TenantCountedList(self.running_per_tenant)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, self.default_weight) if tenant is not None \
            else self.default_weight

    def share(self, tenant: Tenant, extra: int = 0) -> float:
        return (self.running_per_tenant[tenant] + extra) / self.weight(tenant)

    # -- FCFSScheduler's policy hooks ------------------------------------------------------
    def _new_waiting_queue(self) -> FairShareQueue:  # type: ignore[override]
        return FairShareQueue(self.share)

    def _most_served(self) -> Tenant:
        counts = self.running_per_tenant
        return max((t for t, n in counts.items() if n > 0), key=self.share)

    def _newest_of(self, tenant: Tenant) -> Request:
        return next(r for r in reversed(self.running) if r.tenant == tenant)

    def _choose_victim(self, request: Request) -> Request:
        return self._newest_of(self._most_served())

    def _admission_victim(self, request: Request) -> Request | None:
        if not self.running:
            return None
        tenant = self._most_served()
        if self.share(tenant) <= self.share(request.tenant, extra=1):
            return None  # the newcomer's tenant would not be below it: no reclaiming
        return self._newest_of(tenant)
