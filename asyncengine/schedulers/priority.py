"""PriorityScheduler: FCFS with an urgency order.

``request.priority``: lower is more urgent; ties go to the earlier arrival. Waiting requests
are admitted most urgent first; running requests get the step's budget most urgent first; when
blocks run out the LEAST urgent running request is preempted (which may be the one being
scheduled); and a waiting request that does not fit (blocks or ``max_num_seqs``) preempts
running requests of a strictly less urgent priority class to get in.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from asyncengine.request import Request
from asyncengine.schedulers.fcfs import FCFSScheduler


def urgency(request: Request) -> tuple[int, float]:
    """Sort key: smaller is more urgent."""
    return (request.priority, request.arrival_time)


class PriorityQueue:
    """Waiting requests by urgency; a preempted request goes back in at its own rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # ties: insertion order

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*urgency(request), next(self._counter), request))

    add_front = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


class PriorityScheduler(FCFSScheduler):
    """Admission, budget and preemption by ``request.priority`` (lower = more urgent)."""

    def _new_waiting_queue(self) -> PriorityQueue:  # type: ignore[override]
        return PriorityQueue()

    def _running_order(self) -> list[Request]:
        return sorted(self.running, key=urgency)

    def _choose_victim(self, request: Request) -> Request:
        return max(self.running, key=urgency)

    def _admission_victim(self, request: Request) -> Request | None:
        victim = max(self.running, key=urgency, default=None)
        if victim is None or victim.priority <= request.priority:
            return None
        return victim
