"""A storm of aborts over a deep queue (10,000 clients timing out together) never stalls the
event loop: a task ticking every millisecond keeps ticking, and every request is gone after.

A stall is measured as the event-loop thread's CPU time between two ticks: the work the loop
did while the ticker waited. Wall-clock gaps also count the time other processes on a shared
machine take the CPU away; they are bounded more loosely (an O(queue) abort costs seconds)."""

from __future__ import annotations

import time

import anyio

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine

NUM_REQUESTS = 10_000
MAX_STALL_S = 0.05
MAX_WALL_GAP_S = 0.5


def test_10000_queued_requests_aborted_at_once(tiny_llama):
    config = EngineConfig.from_dict(dict(
        model=tiny_llama, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
        num_gpu_blocks_override=64, max_queued_requests=NUM_REQUESTS))
    engine = AsyncEngine(config)

    async def main():
        gaps: list[tuple[float, float]] = []  # (loop-thread CPU time, wall time)
        done = anyio.Event()

        async def ticker():
            last = (time.thread_time(), time.perf_counter())
            while not done.is_set():
                await anyio.sleep(0.001)
                now = (time.thread_time(), time.perf_counter())
                gaps.append((now[0] - last[0], now[1] - last[1]))
                last = now

        async with engine, anyio.create_task_group() as tg:
            streams = [await engine.add_request([5 + i % 100, 6, 7], SamplingParams(max_tokens=8))
                       for i in range(NUM_REQUESTS)]
            waiting = engine.stats().num_waiting
            tg.start_soon(ticker)
            await anyio.sleep(0.05)  # the ticker is ticking, the first requests are running
            for s in streams:  # every consumer leaves at once
                s.close()
            with anyio.fail_after(30):
                while engine.num_unfinished_requests:
                    await anyio.sleep(0.005)
            await anyio.sleep(0.05)
            done.set()
            free = engine.num_free_blocks == engine.num_total_blocks
        return waiting, gaps, free

    waiting, gaps, free = anyio.run(main)
    assert waiting >= NUM_REQUESTS - 8  # nearly all of them were queued, not running
    assert free
    assert len(gaps) > 20
    stall = max(cpu for cpu, _ in gaps)
    wall = max(w for _, w in gaps)
    assert stall < MAX_STALL_S, f"the loop stalled for {stall * 1e3:.1f} ms"
    assert wall < MAX_WALL_GAP_S, f"the ticker waited {wall * 1e3:.1f} ms"
