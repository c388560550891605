"""Async scheduling: step N+1 is launched before step N's ids reach the host, results stay
correct, and an abort while a step is in flight leaks nothing."""

from __future__ import annotations

import threading
import time

import anyio

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time, in a land far away, there lived a"]


def make_engine(model: str, **overrides) -> AsyncEngine:
    return AsyncEngine(EngineConfig.from_dict({
        "model": model, "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64,
        "block_size": 8, "num_gpu_blocks_override": 96, "max_model_len": 256, **overrides}))


async def greedy(engine: AsyncEngine, prompts: list[str], n: int) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    async def one(i: int, prompt: str) -> None:
        async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=n,
                                                                ignore_eos=True)):
            results[i] = out.outputs[0].token_ids

    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):
            tg.start_soon(one, i, p)
    return [results[i] for i in range(len(prompts))]


def test_step_n_plus_1_is_launched_before_step_n_reaches_the_host(tiny_llama):
    """An instrumented device and scheduler record the order of events: every step after the
    first was launched (and queued on the device) before the previous step's sampled ids were
    applied on the host; and the device starts the next step as soon as one ends."""
    engine = make_engine(tiny_llama)
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    launched = [0]

    real_launch, real_execute = engine.device.launch, engine.runner.execute
    real_update = engine.scheduler.update_from_output
    step_of: dict[int, int] = {}  # executed steps, numbered in order

    def launch(fn):
        n = launched[0]
        launched[0] += 1
        with lock:
            events.append(("launch", n, time.perf_counter()))
        return real_launch(fn)

    def execute(inputs):
        n = len(step_of)  # the device runs steps in launch order
        step_of[n] = n
        with lock:
            events.append(("start", n, time.perf_counter()))
        time.sleep(0.01)  # a device step long enough to show the overlap
        out = real_execute(inputs)
        with lock:
            events.append(("end", n, time.perf_counter()))
        return out

    updates = [0]

    def update(out, result):
        with lock:
            events.append(("update", updates[0], time.perf_counter()))
        updates[0] += 1
        return real_update(out, result)

    engine.device.launch = launch
    engine.runner.execute = execute
    engine.scheduler.update_from_output = update

    async def main():
        async with engine:
            return await greedy(engine, PROMPTS, 12)

    got = anyio.run(main)
    reference = make_engine(tiny_llama)

    async def ref():
        async with reference:
            return await greedy(reference, PROMPTS, 12)

    assert got == anyio.run(ref)  # the same tokens as an uninstrumented engine
    order = {(kind, n): i for i, (kind, n, _) in enumerate(events)}
    steps = launched[0]
    assert steps >= 12
    for n in range(steps - 1):
        assert order[("launch", n + 1)] < order[("update", n)], f"step {n + 1} waited for {n}"
    # Step N+1 was already queued while step N still ran on the device (its 10 ms), so the
    # device never waited for the host to schedule and prepare it.
    at = {(kind, n): t for kind, n, t in events}
    queued_early = sum(at[("launch", n + 1)] < at[("end", n)] for n in range(steps - 1))
    assert queued_early >= 0.8 * (steps - 1)


def test_abort_during_an_in_flight_step_frees_every_block(tiny_llama):
    """Requests aborted while their step runs on the device: that step completes, its result
    for them is dropped, every block comes back, and the others finish with the tokens they
    would have had alone."""
    engine = make_engine(tiny_llama)
    real_execute = engine.runner.execute
    in_step = threading.Event()

    def execute(inputs):
        in_step.set()
        time.sleep(0.02)
        out = real_execute(inputs)
        in_step.clear()
        return out

    engine.runner.execute = execute

    async def main():
        async with engine:
            alone = await greedy(engine, PROMPTS[:2], 10)
            kept: dict[int, list[int]] = {}
            aborted_in_flight: list[bool] = []

            async def keep(i: int) -> None:
                async for out in engine.generate(PROMPTS[i], SamplingParams(
                        temperature=0, max_tokens=10, ignore_eos=True)):
                    kept[i] = out.outputs[0].token_ids

            async def drop(prompt: str, after: int) -> None:
                rid = f"drop-{after}"
                async for out in engine.generate(prompt, SamplingParams(max_tokens=50,
                                                                        ignore_eos=True),
                                                 request_id=rid):
                    if len(out.outputs[0].token_ids) >= after:
                        # a launched step that is not processed yet computes this request
                        aborted_in_flight.append(any(
                            s.request.request_id == rid
                            for step in engine.loop.in_flight for s in step.out.scheduled))
                        break  # leaving the stream aborts the request

            async with anyio.create_task_group() as tg:
                tg.start_soon(keep, 0)
                tg.start_soon(keep, 1)
                for k in range(6):
                    tg.start_soon(drop, PROMPTS[k % 4] + " again", 1 + k)
            with anyio.fail_after(10):
                while engine.num_unfinished_requests:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # the last in-flight step completes
            return (alone, [kept[0], kept[1]], engine.num_free_blocks, engine.num_total_blocks,
                    aborted_in_flight)

    alone, kept, free, total, aborted_in_flight = anyio.run(main)
    assert kept == alone
    assert free == total
    assert aborted_in_flight == [True] * 6  # every abort landed while its step was in flight
