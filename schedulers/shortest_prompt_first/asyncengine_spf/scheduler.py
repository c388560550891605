"""Shortest prompt first, with starvation protection: among waiting requests, admit the one
with the fewest tokens to compute, unless the oldest waiting request has already been
overtaken ``max_skips`` times, in which case it goes next.

Only the waiting-queue order differs from the built-in FCFS scheduler, so this subclasses it
and replaces its queue; batching, chunked prefill, prefix caching and preemption are FCFS's.
Preempted requests go back to the front of the queue, as in FCFS: they already waited their
turn. Options (``--scheduler-config``)::

    {"max_skips": 16}     # how many later, shorter requests may overtake a waiting one

Without the bound a long prompt could wait forever while short ones keep arriving; with it, a
request waits for at most ``max_skips`` admissions after the ones ahead of it in arrival order.
``max_skips: 0`` is FCFS.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from asyncengine.plugins import EngineConfig, FCFSQueue, FCFSScheduler, Request

DEFAULT_MAX_SKIPS = 16


def parse_options(options: dict[str, Any] | None) -> int:
    options = dict(options or {})
    max_skips = options.pop("max_skips", DEFAULT_MAX_SKIPS)
    if options:
        raise ValueError(f"--scheduler-config: spf does not know {sorted(options)} "
                         "(known: max_skips)")
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0:
        raise ValueError("--scheduler-config: spf 'max_skips' must be a non-negative integer, "
                         f"got {max_skips!r}")
    return max_skips


class ShortestFirstQueue:
    """New requests by token count (ties: arrival), behind preempted ones, with aging.

    Removal is O(1): entries of requests no longer waiting are dropped lazily when they reach
    the head of the heap or of the arrival list, and compacted away when they outnumber the
    live ones.
    """

    def __init__(self, max_skips: int = DEFAULT_MAX_SKIPS) -> None:
        self.max_skips = max_skips
        self._front = FCFSQueue()  # preempted requests
        self._live: dict[str, tuple[Request, int]] = {}  # id -> (request, admissions at arrival)
        self._heap: list[tuple[int, int, Request]] = []
        self._arrivals: deque[tuple[int, Request]] = deque()
        self._seqs: dict[str, int] = {}  # id -> the sequence number of its live entries
        self._seq = itertools.count()
        self._admitted = 0  # new requests popped so far

    def _is_live(self, seq: int, request: Request) -> bool:
        entry = self._live.get(request.request_id)
        return entry is not None and entry[0] is request and self._seqs[request.request_id] == seq

    def add(self, request: Request) -> None:
        seq = next(self._seq)
        self._live[request.request_id] = (request, self._admitted)
        self._seqs[request.request_id] = seq
        heapq.heappush(self._heap, (request.num_tokens, seq, request))
        self._arrivals.append((seq, request))

    def add_front(self, request: Request) -> None:
        self._front.add_front(request)

    def _oldest(self) -> tuple[Request, int] | None:
        a = self._arrivals
        while a and not self._is_live(*a[0]):
            a.popleft()
        return self._live[a[0][1].request_id] if a else None

    def _shortest(self) -> Request:
        h = self._heap
        while not self._is_live(h[0][1], h[0][2]):
            heapq.heappop(h)
        return h[0][2]

    def peek(self) -> Request:
        if self._front:
            return self._front.peek()
        oldest = self._oldest()
        if oldest is None:
            raise IndexError("peek from an empty queue")
        request, arrived_at = oldest
        if self._admitted - arrived_at >= self.max_skips:
            return request  # overtaken often enough: its turn
        return self._shortest()

    def pop(self) -> Request:
        if self._front:
            return self._front.pop()
        request = self.peek()
        self._forget(request)
        self._admitted += 1
        return request

    def remove(self, request: Request) -> None:
        if request in self._front:
            self._front.remove(request)
        elif request.request_id in self._live:
            self._forget(request)

    def _forget(self, request: Request) -> None:
        del self._live[request.request_id]
        del self._seqs[request.request_id]
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._is_live(e[1], e[2])]
            heapq.heapify(self._heap)
            self._arrivals = deque(e for e in self._arrivals if self._is_live(*e))

    def __contains__(self, request: Request) -> bool:
        return request in self._front or request.request_id in self._live

    def __len__(self) -> int:
        return len(self._front) + len(self._live)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        yield from self._front
        yield from (r for _, seq, r in sorted(self._heap, key=lambda e: e[:2])
                    if self._is_live(seq, r))


class ShortestPromptFirstScheduler(FCFSScheduler):
    """FCFS batching; waiting requests are admitted shortest first, oldest after
    ``max_skips`` overtakes."""

    # The CONTRACT_VERSION["scheduler"] this was written against (asyncengine refuses the
    # class at start-up if it no longer accepts it).
    contract_version = 2

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.max_skips = parse_options(config.scheduler.scheduler_config)
        super().__init__(config, num_blocks)

    def _new_waiting_queue(self) -> ShortestFirstQueue:  # type: ignore[override]
        return ShortestFirstQueue(self.max_skips)
