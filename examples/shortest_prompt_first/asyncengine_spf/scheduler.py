"""Shortest prompt first: among waiting requests, admit the one with the fewest tokens to
compute next.

Only the waiting-queue order differs from the built-in FCFS scheduler, so this subclasses it
and replaces its queue; batching, chunked prefill, prefix caching and preemption are FCFS's.
Preempted requests go back to the front of the queue, as in FCFS: they already waited their
turn, and putting them back by length could starve a long one forever.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from asyncengine.core.request import Request
from asyncengine.core.sched.fcfs import FCFSScheduler


class ShortestFirstQueue:
    """New requests ordered by token count (ties: arrival order), behind preempted ones."""

    def __init__(self) -> None:
        self._front: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.num_tokens, next(self._counter), request))

    def add_front(self, request: Request) -> None:
        self._front.appendleft(request)

    def peek(self) -> Request:
        return self._front[0] if self._front else self._heap[0][-1]

    def pop(self) -> Request:
        return self._front.popleft() if self._front else heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if request in self._front:
            self._front.remove(request)
            return
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._front) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        yield from self._front
        yield from (e[-1] for e in sorted(self._heap, key=lambda e: e[:2]))


class ShortestPromptFirstScheduler(FCFSScheduler):
    """FCFS batching; waiting requests are admitted shortest first."""

    # The SchedulerInterface version this was written against (asyncengine refuses the class
    # at start-up if it implements another one).
    contract_version = 2

    def _new_waiting_queue(self) -> ShortestFirstQueue:  # type: ignore[override]
        return ShortestFirstQueue()
