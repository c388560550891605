"""PriorityScheduler: FCFS with an urgency order.

``request.priority``: lower is more urgent; ties go to the earlier arrival. Waiting requests
are admitted most urgent first; running requests get the step's budget most urgent first; when
blocks run out the LEAST urgent running request is preempted (which may be the one being
scheduled); and a waiting request that does not fit (blocks or ``max_num_seqs``) preempts
running requests of a strictly less urgent priority class to get in.
"""

from __future__ import annotations

from asyncengine.core.request import Request
from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.core.sched.queues import PriorityQueue, urgency


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
