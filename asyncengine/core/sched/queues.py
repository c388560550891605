"""Waiting queues: arrival order (``FCFSQueue``) and urgency order (``PriorityQueue``).

Removing a request that is still waiting (an abort, a client gone) is O(1) in both: the entry
is forgotten in ``_live`` and dropped lazily when it reaches the head. A storm of aborts over a
deep queue therefore costs one dict operation each, not a rebuild of the queue. Stale entries
are compacted away once they outnumber the live ones, so memory stays O(live requests).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from asyncengine.core.request import Request


def urgency(request: Request) -> tuple[int, float]:
    """Sort key of ``PriorityQueue``: smaller is more urgent (priority, then arrival)."""
    return (request.priority, request.arrival_time)


class _LazyQueue:
    """Shared bookkeeping: ``_live[request]`` is the token of its one live entry."""

    def __init__(self) -> None:
        self._live: dict[Request, int] = {}
        self._tokens = itertools.count()

    def _stamp(self, request: Request) -> int:
        token = next(self._tokens)
        self._live[request] = token
        return token

    def _is_live(self, token: int, request: Request) -> bool:
        return self._live.get(request) == token

    def remove(self, request: Request) -> None:
        """Forget a waiting request (unknown ones are ignored). O(1)."""
        if self._live.pop(request, None) is not None:
            self._maybe_compact()

    def __contains__(self, request: Request) -> bool:
        return request in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def _num_entries(self) -> int:
        raise NotImplementedError

    def _compact(self) -> None:
        raise NotImplementedError

    def _maybe_compact(self) -> None:
        if self._num_entries() > 2 * len(self._live) + 64:
            self._compact()


class FCFSQueue(_LazyQueue):
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[int, Request]] = deque()

    def add(self, request: Request) -> None:
        self._queue.append((self._stamp(request), request))

    def add_front(self, request: Request) -> None:
        self._queue.appendleft((self._stamp(request), request))

    def _drop_stale_head(self) -> None:
        q = self._queue
        while q and not self._is_live(*q[0]):
            q.popleft()

    def peek(self) -> Request:
        self._drop_stale_head()
        return self._queue[0][1]

    def pop(self) -> Request:
        self._drop_stale_head()
        _, request = self._queue.popleft()
        del self._live[request]
        return request

    def __iter__(self) -> Iterator[Request]:
        return (r for t, r in list(self._queue) if self._is_live(t, r))

    def _num_entries(self) -> int:
        return len(self._queue)

    def _compact(self) -> None:
        self._queue = deque(e for e in self._queue if self._is_live(*e))


class PriorityQueue(_LazyQueue):
    """Waiting requests by urgency; a preempted request goes back in at its own rank."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        # The token doubles as the tie-break: insertion order among equal urgencies.
        heapq.heappush(self._heap, (*urgency(request), self._stamp(request), request))

    add_front = add

    def _drop_stale_head(self) -> None:
        h = self._heap
        while h and not self._is_live(h[0][2], h[0][3]):
            heapq.heappop(h)

    def peek(self) -> Request:
        self._drop_stale_head()
        return self._heap[0][-1]

    def pop(self) -> Request:
        self._drop_stale_head()
        request = heapq.heappop(self._heap)[-1]
        del self._live[request]
        return request

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3])
                if self._is_live(e[2], e[3]))

    def _num_entries(self) -> int:
        return len(self._heap)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._is_live(e[2], e[3])]
        heapq.heapify(self._heap)
