"""Two engines in one process (a router) keep their own CPU threads and the loop thread's
scheduling policy: neither is a process-global that the last engine built or left takes."""

from __future__ import annotations

import os

import anyio
import pytest
import torch

from asyncengine.executor.runtime.device import CPUDevice
from asyncengine.executor.runtime.thread_policy import BatchScheduled


def test_each_cpu_device_computes_with_its_own_thread_count():
    """The second device's count does not become the first one's: each worker (and each
    start-up thread) keeps its own, whatever torch's process-wide default is now."""

    async def main():
        one, two = CPUDevice(1), CPUDevice(2)
        try:
            return [await d.launch(torch.get_num_threads).wait() for d in (one, two, one)], [
                d.run_at_start_up(torch.get_num_threads) for d in (one, two)]
        finally:
            await one.aclose()
            await two.aclose()

    workers, start_up = anyio.run(main)
    assert workers == [1, 2, 1] and start_up == [1, 2]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")
def test_the_loop_thread_stays_batch_scheduled_until_the_last_engine_leaves(monkeypatch):
    monkeypatch.delenv("ASYNCENGINE_LOOP_SCHED_BATCH", raising=False)
    before = os.sched_getscheduler(0)
    assert before == os.SCHED_OTHER
    a, b = BatchScheduled(), BatchScheduled()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # one model unloaded: the other still runs
    assert os.sched_getscheduler(0) == os.SCHED_BATCH
    a.__exit__(None, None, None)  # (twice: nothing)
    assert os.sched_getscheduler(0) == os.SCHED_BATCH
    b.__exit__(None, None, None)
    assert os.sched_getscheduler(0) == before
    with BatchScheduled():  # entered again afterwards: as the first time
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == before


def test_two_loads_at_once_keep_the_load_thresholds_until_the_last_ends(monkeypatch):
    """glibc's malloc thresholds are the process's: two models loading together (a router)
    set the load's once, and the step loop's come back when the last load ends."""
    from asyncengine.executor.runtime import cpu_malloc

    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(cpu_malloc, "keep_step_buffers", lambda: True)
    monkeypatch.setattr(cpu_malloc.ctypes, "CDLL", lambda name: Libc())
    load = (cpu_malloc.M_MMAP_THRESHOLD, cpu_malloc.LOAD_MMAP_THRESHOLD)
    step = (cpu_malloc.M_MMAP_THRESHOLD, cpu_malloc.MMAP_THRESHOLD)
    first = cpu_malloc.freed_blocks_returned(True)
    second = cpu_malloc.freed_blocks_returned(True)
    first.__enter__()
    second.__enter__()
    assert calls.count(load) == 1
    first.__exit__(None, None, None)  # one load ends, the other goes on
    assert step not in calls
    second.__exit__(None, None, None)
    assert calls.count(step) == 1 and calls[-1] == ("trim", 0)
