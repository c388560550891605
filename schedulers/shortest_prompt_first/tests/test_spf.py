"""asyncengine-spf: shortest prompt first in the real engine, its starvation bound, its options
and its entry point."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import anyio
import pytest
import tomllib

DIST = Path(__file__).resolve().parents[1]
if str(DIST) not in sys.path:  # run from a checkout without installing the distribution
    sys.path.insert(0, str(DIST))

import asyncengine_spf.plugin  # noqa: E402
from asyncengine_spf.scheduler import (  # noqa: E402
    ShortestFirstQueue,
    ShortestPromptFirstScheduler,
)

from asyncengine import AsyncEngine  # noqa: E402
from asyncengine.plugins import (  # noqa: E402
    EngineConfig,
    Request,
    SamplingParams,
    new_plugin_manager,
    registered,
)

ENGINE = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 64,
          "max_model_len": 128, "max_num_seqs": 1, "max_num_batched_tokens": 64}
LONG = "Once upon a time, in a land far away, there lived a king who had three daughters and"


def plugin_manager():
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(asyncengine_spf.plugin, name="spf")
    return pm


async def finishing_order(engine: AsyncEngine, prompts: dict[str, str]) -> list[str]:
    """Queue every prompt before the engine's first step; return names in finishing order."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    order: list[str] = []

    async def drain(name: str, stream) -> None:
        async for _ in stream:
            pass
        order.append(name)

    async with engine, anyio.create_task_group() as tg:
        # add_request does not yield to the step loop: all are waiting at the first schedule().
        streams = {name: await engine.add_request(p, params) for name, p in prompts.items()}
        for name, stream in streams.items():
            tg.start_soon(drain, name, stream)
    assert engine.num_free_blocks == engine.num_total_blocks
    return order


def test_shortest_waiting_prompt_goes_first_and_the_long_one_is_not_starved(tiny_llama):
    pm = plugin_manager()
    prompts = {"long": LONG, **{f"short{i}": f"Hi {i}" for i in range(5)}}
    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE})
    spf = AsyncEngine(config.replace(scheduler="spf"), plugin_manager=pm)
    assert type(spf.scheduler).__name__ == "ShortestPromptFirstScheduler"
    # (fcfs would finish "long" first: it arrived first and one request runs at a time.)
    assert anyio.run(finishing_order, spf, prompts)[-1] == "long"  # default bound: 16
    bounded = AsyncEngine(config.replace(scheduler="spf", scheduler_config={"max_skips": 2}),
                          plugin_manager=pm)
    assert anyio.run(finishing_order, bounded, prompts) == [
        "short0", "short1", "long", "short2", "short3", "short4"]


def make_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1))


def test_queue_bound_removal_and_preempted_requests():
    q = ShortestFirstQueue(max_skips=1)
    long, a, b, c = (make_request("long", 50), make_request("a", 3), make_request("b", 2),
                     make_request("c", 1))
    for r in (long, a, b):
        q.add(r)
    assert len(q) == 3 and list(q) == [b, a, long]
    assert q.pop() is b        # shortest
    q.add(c)
    assert q.pop() is long     # overtaken once: its turn, though c is shorter
    q.remove(a)                # an abort: O(1), dropped lazily
    assert a not in q and len(q) == 1 and q.peek() is c
    q.add_front(a)             # a preempted request goes first
    assert q.pop() is a and q.pop() is c and not q
    with pytest.raises(IndexError):
        q.peek()


def test_options_are_checked():
    config = EngineConfig.from_dict({**ENGINE, "scheduler": "spf"})
    for options, message in [({"max_skips": -1}, "'max_skips' must be a non-negative"),
                             ({"max_skip": 3}, r"does not know \['max_skip'\]")]:
        with pytest.raises(ValueError, match=message):
            ShortestPromptFirstScheduler(config.replace(scheduler_config=options), 64)


def test_the_declared_entry_point_registers_spf():
    project = tomllib.loads((DIST / "pyproject.toml").read_text())
    value = project["project"]["entry-points"]["asyncengine"]["spf"]
    ep = importlib.metadata.EntryPoint("spf", value, "asyncengine")
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(ep.load(), name="spf")
    assert registered("schedulers", pm)["spf"].__name__ == "ShortestPromptFirstScheduler"
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="asyncengine")}
    if "spf" in installed:  # `make install` installs it (editable)
        assert installed["spf"] == value
