"""The CUDA step path on the CPU: awaiting events (thread and poll) with fake events, the
CUDA device's launch order, the pinned staging's packing, and a whole engine whose device is
the CUDA device driven by a fake CUDA (CPU tensors, fake events): same tokens as the CPU
engine. What needs a real GPU is in ``test_gpu.py``."""

from __future__ import annotations

import contextlib
import threading
import time

import anyio
import numpy as np
import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from asyncengine.executor.runtime.cuda_await import (
    PollEventAwaiter,
    ThreadEventAwaiter,
    make_event_awaiter,
)
from asyncengine.executor.runtime.cuda_device import CUDADevice
from asyncengine.executor.runtime.device import HostResult
from asyncengine.executor.runtime.simulated import SimulatedCUDA as FakeCUDA
from asyncengine.executor.runtime.simulated import SimulatedEvent as FakeEvent
from asyncengine.executor.runtime.simulated import on_simulated_cuda as cuda_path
from asyncengine.executor.runtime.staging import ALIGN, PinnedStaging

MECHANISMS = ["thread", "poll"]


async def wait_while_ticking(awaiter, event) -> tuple[int, float]:
    """Await ``event``; meanwhile a task ticks every ms. Returns (ticks, seconds waited)."""
    ticks = 0
    done = False

    async def tick() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        start = time.perf_counter()
        await awaiter.wait(event)
        elapsed = time.perf_counter() - start
        done = True
    return ticks, elapsed


@pytest.mark.parametrize("name", MECHANISMS)
def test_await_wakes_the_loop_and_the_loop_keeps_running(name):
    awaiter = make_event_awaiter(name)
    event = FakeEvent(delay=0.08)
    ticks, elapsed = anyio.run(wait_while_ticking, awaiter, event)
    awaiter.close()
    assert event.query() and elapsed >= 0.07
    assert elapsed < 1.0  # woken promptly, not by a timeout
    assert ticks >= 10  # the loop ran the ticking task all along (~80 ticks of 1 ms)


def test_thread_awaiter_synchronizes_off_the_loop_and_skips_finished_events():
    awaiter = ThreadEventAwaiter()
    loop_thread = threading.get_ident()
    slow = FakeEvent(delay=0.03)
    anyio.run(awaiter.wait, slow)
    assert slow.sync_threads and loop_thread not in slow.sync_threads
    done = FakeEvent(delay=0.0)
    anyio.run(awaiter.wait, done)
    assert done.sync_threads == []  # already complete: no hop to the waiter thread
    awaiter.close()


def test_poll_awaiter_backs_off():
    awaiter = PollEventAwaiter(first_s=20e-6, max_s=1e-3)
    event = FakeEvent(delay=0.05)
    anyio.run(awaiter.wait, event)
    # Doubling from 20 µs to 1 ms: ~7 short polls, then one per ms: far from a busy loop.
    assert 3 <= event.queries <= 120


@pytest.mark.parametrize("name", MECHANISMS)
def test_await_raises_the_events_error(name):
    awaiter = make_event_awaiter(name)
    event = FakeEvent(delay=0.02, error=RuntimeError("CUDA error: an illegal memory access"))

    async def main():
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await awaiter.wait(event)

    anyio.run(main)
    awaiter.close()


@pytest.mark.parametrize("name", MECHANISMS)
def test_cancelling_a_wait_does_not_hang(name):
    awaiter = make_event_awaiter(name)
    never = FakeEvent(delay=None)  # completes only when released

    async def main() -> float:
        start = time.perf_counter()
        with anyio.move_on_after(0.05):
            await awaiter.wait(never)
        return time.perf_counter() - start

    assert anyio.run(main) < 1.0
    never.release()  # the waiter thread (if any) finishes its synchronize
    later = FakeEvent(delay=0.01)
    anyio.run(awaiter.wait, later)  # the mechanism still works after a cancelled wait
    assert later.query()
    awaiter.close()


def test_await_mechanism_from_the_environment(monkeypatch):
    monkeypatch.delenv("ASYNCENGINE_CUDA_AWAIT", raising=False)
    assert make_event_awaiter().name == "thread"
    monkeypatch.setenv("ASYNCENGINE_CUDA_AWAIT", "poll")
    assert make_event_awaiter().name == "poll"
    monkeypatch.setenv("ASYNCENGINE_CUDA_AWAIT", "spin")
    with pytest.raises(ValueError, match="ASYNCENGINE_CUDA_AWAIT"):
        make_event_awaiter()


# -- the CUDA device's launch logic, with a fake CUDA ---------------------------------------------

class Inputs:
    def __init__(self, blocks_host: bool = False, graph_batch: int | None = 1) -> None:
        self.blocks_host = blocks_host
        self.graph_batch = graph_batch


class Runner:
    """Records the order steps are enqueued in."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.lock = threading.Lock()

    def execute(self, inputs) -> int:
        if getattr(inputs, "fail", False):
            raise RuntimeError("bad step")
        if inputs.blocks_host:
            time.sleep(0.02)  # waits for a bitmask on the launcher thread
        with self.lock:
            self.order.append(inputs.n)
        return inputs.n


def test_cuda_device_keeps_launch_order_across_loop_and_launcher_thread():
    cuda = FakeCUDA()
    device = CUDADevice(awaiter="thread", cuda=cuda)
    runner = Runner()

    async def main():
        handles = []
        for n, blocks in enumerate([False, True, False, False, True, False]):
            inputs = Inputs(blocks_host=blocks)
            inputs.n = n
            handles.append(device.launch_step(runner, inputs))
        results = [await h.wait() for h in handles]
        # Once nothing is pending on the thread, a step is enqueued from the loop again.
        later = Inputs()
        later.n = 6
        results.append(await device.launch_step(runner, later).wait())
        return results

    assert anyio.run(main) == list(range(7))
    assert runner.order == list(range(7))  # enqueued in launch order
    # Step 0 from the loop; 1 (blocks the host) and everything behind it on the thread; 6 from
    # the loop again.
    assert cuda.enqueued_on[0] == threading.main_thread().name
    assert cuda.enqueued_on[-1] == threading.main_thread().name
    assert all(name == "asyncengine-device" for name in cuda.enqueued_on[1:6])
    assert device.num_loop_launches == 2 and device.num_thread_launches == 5
    anyio.run(device.aclose)


def test_step_events_come_from_a_pool():
    """``TorchCUDA`` records each step's event on one it made before, given back once the
    step was awaited: steps after the first few create no CUDA event. (The torch module under
    it is a stand-in: the pool is what is checked.)"""
    import contextlib
    from types import SimpleNamespace

    from asyncengine.executor.runtime.cuda_device import TorchCUDA

    made = []

    class Event:
        def __init__(self) -> None:
            made.append(self)
            self.records = 0

        def record(self, stream) -> None:
            self.records += 1

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    cuda = TorchCUDA()
    cuda.torch = SimpleNamespace(cuda=SimpleNamespace(
        Event=Event, Stream=object, stream=lambda s: contextlib.nullcontext(),
        set_stream=lambda s: None))
    device = CUDADevice(awaiter="poll", cuda=cuda)
    runner = Runner()

    async def main():
        for n in range(10):  # two in flight at a time, as the step loop runs them
            inputs, nxt = Inputs(), Inputs(blocks_host=n % 3 == 0)
            inputs.n, nxt.n = 2 * n, 2 * n + 1
            first, second = device.launch_step(runner, inputs), device.launch_step(runner, nxt)
            assert [await first.wait(), await second.wait()] == [2 * n, 2 * n + 1]

    anyio.run(main)
    assert len(made) == 2 and sum(e.records for e in made) == 20
    anyio.run(device.aclose)


def test_cuda_device_delivers_errors_to_the_awaiting_loop():
    device = CUDADevice(awaiter="poll", cuda=FakeCUDA())
    runner = Runner()

    async def main():
        bad = Inputs()
        bad.fail = True
        with pytest.raises(RuntimeError, match="bad step"):
            await device.launch_step(runner, bad).wait()
        bad_on_thread = Inputs(blocks_host=True)
        bad_on_thread.fail = True
        with pytest.raises(RuntimeError, match="bad step"):
            await device.launch_step(runner, bad_on_thread).wait()
        ok = Inputs()
        ok.n = 3
        return await device.launch_step(runner, ok).wait()  # the device goes on

    assert anyio.run(main) == 3
    anyio.run(device.aclose)


@pytest.mark.parametrize("awaiter", MECHANISMS)
def test_a_cuda_step_s_results_are_read_only_after_its_event(awaiter):
    """``finish()`` reads the pinned copies of the sampled ids: only once the step's event,
    recorded after those copies, has completed (from the loop and from the launcher
    thread)."""
    events: list[FakeEvent] = []

    class SlowCUDA(FakeCUDA):
        def record_event(self, stream: object) -> FakeEvent:
            events.append(FakeEvent(delay=0.05))
            return events[-1]

    class Pending(HostResult):
        def finish(self) -> bool:
            return events[-1].query()

    class PendingRunner:
        def execute(self, inputs) -> Pending:
            return Pending()

    device = CUDADevice(awaiter=awaiter, cuda=SlowCUDA())

    async def main():
        from_loop = await device.launch_step(PendingRunner(), Inputs()).wait()
        from_thread = await device.launch_step(PendingRunner(), Inputs(blocks_host=True)).wait()
        return from_loop, from_thread

    assert anyio.run(main) == (True, True)
    anyio.run(device.aclose)


def test_cuda_eager_launch_env(monkeypatch):
    monkeypatch.setenv("ASYNCENGINE_CUDA_EAGER_LAUNCH", "thread")
    assert CUDADevice(cuda=FakeCUDA()).eager_on_thread
    monkeypatch.setenv("ASYNCENGINE_CUDA_EAGER_LAUNCH", "elsewhere")
    with pytest.raises(ValueError, match="ASYNCENGINE_CUDA_EAGER_LAUNCH"):
        CUDADevice(cuda=FakeCUDA())


# -- pinned staging ------------------------------------------------------------------------------

def test_staging_packs_a_step_into_one_upload():
    staging = PinnedStaging("cpu", pin=False, initial_bytes=1024)
    staging.begin()
    arrays = [np.arange(5, dtype=np.int64), np.array([0.5, 1.5], dtype=np.float32),
              np.array([True, False, True]), np.arange(6, dtype=np.int64).reshape(2, 3),
              np.zeros(0, dtype=np.int64)]
    tensors = [staging.put(a) for a in arrays]
    assert all(t.data_ptr() % ALIGN == 0 for t in tensors if t.numel())
    assert not torch.equal(tensors[0], torch.arange(5))  # not uploaded before flush
    staging.flush()
    assert staging.num_uploads == 1
    for a, t in zip(arrays, tensors, strict=True):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape
        assert np.array_equal(t.numpy(), a)
    arrays[0][:] = 7  # the host arrays may change once put: the step has its own copy
    assert tensors[0].tolist() == [0, 1, 2, 3, 4]


def test_staging_spills_then_grows_to_fit_a_step():
    staging = PinnedStaging("cpu", pin=False, initial_bytes=256)
    big = [np.full(20, i, dtype=np.int64) for i in range(4)]  # 4 x 160 bytes > 256
    staging.begin()
    first = [staging.put(a) for a in big]
    staging.flush()
    assert staging.num_uploads > 1
    assert [t.tolist() for t in first] == [a.tolist() for a in big]
    uploads = staging.num_uploads
    staging.begin()
    again = [staging.put(a + 10) for a in big]
    staging.flush()
    assert staging.num_uploads == uploads + 1  # the buffer grew: one upload now
    assert [t.tolist() for t in again] == [(a + 10).tolist() for a in big]
    assert [t.tolist() for t in first] == [a.tolist() for a in big]  # earlier steps intact


# -- a whole engine on the CUDA device's path, with a fake CUDA -----------------------------------

CONFIG = {"dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8,
          "num_gpu_blocks_override": 40, "max_model_len": 256}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time, in a land far away, there lived a"]


async def generate_all(engine: AsyncEngine) -> list:
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5)]
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        async for out in engine.generate(PROMPTS[i], params[i]):
            results[i] = out

    async with engine:
        async with anyio.create_task_group() as tg:
            for i in (0, 1, 3):
                tg.start_soon(one, i)
        await one(2)  # alone: its steps wait on the host, so they go to the launcher thread
    return [results[i] for i in range(len(PROMPTS))]


def summary(out) -> tuple:
    o = out.outputs[0]
    lps = [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in o.logprobs or []]
    plp = [None if e is None else sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
           for e in out.prompt_logprobs or []]
    return o.token_ids, lps, plp


@pytest.mark.parametrize("awaiter", MECHANISMS)
def test_engine_on_the_cuda_step_path_matches_the_cpu_engine(tiny_llama, awaiter):
    """Greedy with logprobs, seeded sampling, prompt logprobs (launched from the launcher
    thread) and penalties, with chunked prefill: the CUDA device's path (steps enqueued,
    pending host results, event awaits, packed staging) gives exactly the CPU engine's outputs."""
    reference = anyio.run(generate_all, AsyncEngine(EngineConfig.from_dict(
        {"model": tiny_llama, **CONFIG})))
    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, **CONFIG}))
    device = cuda_path(engine, awaiter)
    executed = []
    real_execute = engine.runner.execute
    engine.runner.execute = lambda inputs: executed.append(inputs) or real_execute(inputs)
    got = anyio.run(generate_all, engine)
    assert [summary(o) for o in got] == [summary(o) for o in reference]
    # every step was enqueued by the CUDA device, from the loop or the launcher thread
    assert len(executed) == device.num_loop_launches + device.num_thread_launches
    assert device.num_loop_launches > 0  # plain steps: from the loop, no thread hop
    assert device.num_thread_launches > 0  # prompt-logprobs steps: on the launcher thread
    assert engine.num_free_blocks == engine.num_total_blocks


# -- KV-connector block copies: a side stream ordered by events ----------------------------------

class _LogStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        self.log.append(f"{self.name} waits {event.name}")


class _LogCUDA:
    """torch.cuda's stream/event surface, logging the order of what is enqueued."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.current = "default"
        self.events = 0
        cuda = self

        class Event:
            def __init__(self) -> None:
                cuda.events += 1
                self.name = f"e{cuda.events}"
                self.synced = False

            def record(self, stream) -> None:
                cuda.log.append(f"{self.name} on {stream.name}")

            def synchronize(self) -> None:
                self.synced = True
                cuda.log.append(f"host waits {self.name}")

        self.Event = Event

    def Stream(self, device=None) -> _LogStream:  # noqa: N802 (torch's name)
        return _LogStream("side", self.log)

    def stream(self, s):

        @contextlib.contextmanager
        def on():
            before, self.current = self.current, s.name
            self.log.append(f"enter {s.name}")
            yield
            self.log.append(f"leave {s.name}")
            self.current = before
        return on()


def test_kv_block_copies_go_on_a_side_stream_ordered_by_events(monkeypatch):
    """Reads gather after the step that computed the blocks and hold later steps back only
    for the gather; writes stage the data before waiting for the device stream, scatter, and
    make the next step wait for the scatter. The data is what the CPU path copies."""
    import torch

    from asyncengine.executor.kv import blocks as kv_blocks

    fake = _LogCUDA()
    monkeypatch.setattr(kv_blocks, "_cuda", fake)
    monkeypatch.setattr(kv_blocks, "_side_streams", {})
    monkeypatch.setattr(kv_blocks, "_pin", lambda t: t.clone())
    device_stream = _LogStream("device", fake.log)
    caches = [torch.randn(2, 6, 4, 2, 8) for _ in range(3)]
    expected = kv_blocks.read_blocks(caches, [4, 1], torch.device("cpu")).wait()

    copy = kv_blocks.read_blocks(caches, [4, 1], torch.device("cpu"), device_stream)
    assert fake.log == ["e1 on device", "side waits e1", "enter side", "e2 on side",
                        "device waits e2", "e3 on side", "leave side"]
    assert not copy.event.synced
    assert torch.equal(copy.wait(), expected) and fake.log[-1] == "host waits e3"
    assert kv_blocks.side_stream(device_stream) is kv_blocks.side_stream(device_stream)

    fake.log.clear()
    new = torch.randn(2, 3, 2, 4, 2, 8)
    kv_blocks.write_blocks(caches, [0, 5], new, torch.device("cpu"), device_stream)
    assert fake.log == ["enter side", "e4 on device", "side waits e4", "e5 on side",
                        "leave side", "device waits e5", "host waits e5"]
    got = kv_blocks.read_blocks(caches, [0, 5], torch.device("cpu")).wait()
    assert torch.equal(got, new)
    with pytest.raises(ValueError, match="do not fit"):
        kv_blocks.write_blocks(caches, [0], new, torch.device("cpu"), device_stream)


def test_tp_runner_reads_its_step_message_from_the_host_not_the_staged_upload(monkeypatch):
    """On CUDA a staged tensor is a view of a device buffer that its upload (non_blocking, on
    the device's stream) may not have filled when the loop reads it: the tensor-parallel
    runner's step message must come from the host arrays. A staging whose tensors are not
    filled yet (-1) shows it."""
    from types import SimpleNamespace

    from asyncengine.core.request import Request
    from asyncengine.core.sched.fcfs import FCFSScheduler
    from asyncengine.executor.attention.torch_paged import TorchPagedBackend
    from asyncengine.executor.parallel import runner as tp_runner
    from asyncengine.executor.runtime.staging import DirectStaging

    class NotYetUploaded(DirectStaging):
        def put(self, array):
            return torch.full(np.shape(array), -1, dtype=torch.from_numpy(
                np.ascontiguousarray(array)).dtype)

    sent = []
    monkeypatch.setattr(tp_runner, "encode_step", lambda *a: sent.append(a) or "message")
    config = EngineConfig.from_dict({"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                     "block_size": 4, "max_model_len": 64})
    scheduler = FCFSScheduler(config, 32)
    runner = tp_runner.TPModelRunner(
        SimpleNamespace(vocab_size=500), TorchPagedBackend(), [], 4, torch.device("cpu"),
        frozenset(), max_num_seqs=4, max_model_len=64, staging=NotYetUploaded(),
        tp=SimpleNamespace())
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, n in enumerate([5, 3, 7]):
        scheduler.add_request(Request(f"r{i}", list(range(10, 10 + n)), params,
                                      max_model_len=64))
    inputs = runner.prepare(scheduler.schedule())
    assert inputs.tp_message == "message"
    (args,) = sent
    assert args[5].tolist() == [4, 7, 14]  # each prompt's last token: where it samples
    assert inputs.sample_indices_host.tolist() == [4, 7, 14]
