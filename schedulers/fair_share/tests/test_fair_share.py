"""asyncengine-fair-share: a tenant flooding the server does not starve a light tenant (its
TTFT, measured on the real engine, stays within 2x of running alone, where FCFS starves it);
weights; the tenant from X-Tenant or the API key reaches the scheduler; options; entry point."""

from __future__ import annotations

import importlib.metadata
import random
import sys
import time
from pathlib import Path

import anyio
import pytest
import tomllib

DIST = Path(__file__).resolve().parents[1]
if str(DIST) not in sys.path:  # run from a checkout without installing the distribution
    sys.path.insert(0, str(DIST))

import asyncengine_fair_share.plugin  # noqa: E402
from asyncengine_fair_share.scheduler import FairShareQueue, FairShareScheduler  # noqa: E402

from asyncengine import AsyncEngine  # noqa: E402
from asyncengine.plugins import (  # noqa: E402
    EngineConfig,
    Request,
    SamplingParams,
    new_plugin_manager,
    registered,
)

# 4 slots, a 128-token budget per step: the light tenant's two 480-token prompts take ~8 steps
# of prefill alone, so its TTFT is mostly its own compute, not the loop's per-step overhead.
ENGINE = {"dtype": "float32", "block_size": 16, "num_gpu_blocks_override": 256,
          "max_model_len": 1024, "max_num_seqs": 4, "max_num_batched_tokens": 128,
          "enable_prefix_caching": False}  # every run computes the light prompts again
FLOOD = 30
LIGHT = [[random.Random(i).randrange(3, 40000) for _ in range(480)] for i in range(2)]


def plugin_manager():
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(asyncengine_fair_share.plugin, name="fair-share")
    return pm


async def light_ttft(engine: AsyncEngine, *, flood: bool,
                     limit: float = 60.0) -> tuple[float, int]:
    """Seconds, and engine steps, until both of the light tenant's requests have their first
    token, sent while the heavy tenant's 30 requests fill every slot (``flood``) or on an idle
    engine. ``(inf, steps)`` if that takes more than ``limit`` seconds."""
    heavy = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    light = SamplingParams(temperature=0, max_tokens=1)
    decoding = anyio.Event()
    started = 0
    ttft = float("inf")
    steps = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():
        steps[0] += 1
        return schedule()

    async def heavy_request(i: int) -> None:
        nonlocal started
        first = True
        async for _ in engine.generate(f"heavy request {i}", heavy, tenant="heavy"):
            if first:
                first = False
                started += 1
                if started >= ENGINE["max_num_seqs"]:
                    decoding.set()

    async def light_request(prompt: list[int], done: list[float]) -> None:
        async for _ in engine.generate(prompt, light, tenant="light"):
            done.append(time.perf_counter())
            break

    async with engine, anyio.create_task_group() as tg:
        if flood:
            for i in range(FLOOD):
                tg.start_soon(heavy_request, i)
            await decoding.wait()  # every slot holds a heavy request
        done: list[float] = []
        engine.scheduler.schedule = counting_schedule
        t0 = time.perf_counter()
        with anyio.move_on_after(limit):
            async with anyio.create_task_group() as light_tg:
                for prompt in LIGHT:
                    light_tg.start_soon(light_request, prompt, done)
        if len(done) == len(LIGHT):
            ttft = max(done) - t0
        used = steps[0]
        del engine.scheduler.schedule
        tg.cancel_scope.cancel()  # the flood is not the point: abort it
    assert engine.num_free_blocks == engine.num_total_blocks
    return ttft, used


def test_a_flooding_tenant_does_not_starve_a_light_one(tiny_llama):
    pm = plugin_manager()
    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE, "scheduler": "fair-share"})
    engine = AsyncEngine(config, plugin_manager=pm)
    anyio.run(lambda: light_ttft(engine, flood=False))  # warm-up (first-step costs)
    # Wall time on a shared machine is noisy: alone and beside the flood are measured in turn,
    # up to 3 times, and the best pair counts. The step count is the same every time.
    for _ in range(3):
        alone, alone_steps = anyio.run(lambda: light_ttft(engine, flood=False))
        shared, shared_steps = anyio.run(lambda: light_ttft(engine, flood=True))
        print(f"light TTFT: alone {alone:.3f}s ({alone_steps} steps), beside the flood "
              f"{shared:.3f}s ({shared_steps} steps)")
        assert shared_steps <= 2 * alone_steps
        if shared <= 2 * alone:
            break
    assert shared <= 2 * alone, f"light tenant's TTFT {shared:.3f}s vs {alone:.3f}s alone"

    # The same flood under FCFS: the light tenant waits behind the 30 heavy requests.
    fcfs = AsyncEngine(config.replace(scheduler="fcfs"), plugin_manager=pm)
    # (It would wait for ~30 x 200 / 4 = 1500 heavy decode steps.)
    starved, _ = anyio.run(lambda: light_ttft(fcfs, flood=True, limit=2 * alone))
    assert starved == float("inf")


def make_request(rid: str, tenant: str | None, n: int = 4) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=1), tenant=tenant)


def test_weights_divide_the_slots():
    config = EngineConfig.from_dict({**ENGINE, "max_num_seqs": 8, "scheduler": "fair-share",
                                     "scheduler_config": {"weights": {"gold": 3}}})
    sched = FairShareScheduler(config, 256)
    for i in range(20):  # both tenants flood, gold first
        sched.add_request(make_request(f"gold{i}", "gold"))
    for i in range(20):
        sched.add_request(make_request(f"free{i}", None))
    sched.schedule()
    assert sched.running_per_tenant == {"gold": 6, None: 2}  # 3:1 of 8 slots
    # A new tenant arrives: it takes a slot from the tenant most above its share.
    sched.add_request(make_request("new0", "new"))
    sched.add_request(make_request("new1", "new"))
    out = sched.schedule()
    # gold (6/3) and the default tenant (2/1) are both at share 2: the newest gold request
    # makes room; the second newcomer would put "new" at 2 too, so it waits.
    assert out.preempted_req_ids == {"gold5"}
    assert sched.running_per_tenant == {"gold": 5, None: 2, "new": 1}
    sched.finish_requests(list(sched.requests), sched.requests["gold0"].status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 256
    assert not sched.waiting and not sched.running and not sched.running_per_tenant.total()


def test_queue_orders_by_share_then_arrival():
    running = {"a": 2, "b": 0}
    q = FairShareQueue(lambda t: running.get(t, 0))
    a1, a2, b1 = make_request("a1", "a"), make_request("a2", "a"), make_request("b1", "b")
    for r in (a1, a2, b1):
        q.add(r)
    assert len(q) == 3 and list(q) == [a1, a2, b1]
    assert q.peek() is b1 and q.pop() is b1  # b holds fewer slots
    running["b"] = 5
    q.remove(a1)  # an abort
    assert q.peek() is a2 and a1 not in q and q.tenants() == ["a"]
    q.add_front(a1)  # preempted: back at the front of its tenant
    assert q.pop() is a2  # pop() takes what peek() chose (the scheduler preempts for it)
    assert q.peek() is a1 and q.pop() is a1 and not q


def test_tenant_comes_from_x_tenant_or_the_api_key(tiny_llama):
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE, "scheduler": "fair-share"})
    engine = AsyncEngine(config, plugin_manager=plugin_manager())
    seen: list[str | None] = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda r: (seen.append(r.tenant), add(r))[1]
    body = {"model": engine.model_name, "prompt": "hello", "max_tokens": 2}

    async def main() -> list[int]:
        statuses = []
        async with engine:
            app = build_app(engine, None, ServerSettings())
            async with TestClient(TestServer(app)) as c:
                for headers in ({"X-Tenant": "team-a"}, {"Authorization": "Bearer sk-123"}, {},
                                {"X-Tenant": "bad tenant!"}):
                    r = await c.post("/v1/completions", json=body, headers=headers)
                    statuses.append(r.status)
                    if r.status == 400:
                        assert (await r.json())["error"]["param"] == "X-Tenant"
        return statuses

    assert anyio.run(main) == [200, 200, 200, 400]
    assert seen[0] == "team-a" and seen[2] is None
    assert seen[1].startswith("key-") and "sk-123" not in seen[1]


@pytest.mark.parametrize("trust", [False, True])
def test_a_keyed_server_takes_x_tenant_only_when_told_to(tiny_llama, trust):
    """With --api-key, a key holder naming another tenant would take that tenant's share:
    X-Tenant is ignored (the key is the tenant) unless --trust-tenant-header."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE, "scheduler": "fair-share"})
    engine = AsyncEngine(config, plugin_manager=plugin_manager())
    seen: list[str | None] = []
    add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda r: (seen.append(r.tenant), add(r))[1]
    body = {"model": engine.model_name, "prompt": "hello", "max_tokens": 2}
    key = {"Authorization": "Bearer sk-123"}

    async def main() -> list[int]:
        async with engine:
            app = build_app(engine, None, ServerSettings(api_key="sk-123",
                                                         trust_tenant_header=trust))
            async with TestClient(TestServer(app)) as c:
                return [(await c.post("/v1/completions", json=body,
                                      headers={**key, **extra})).status
                        for extra in ({"X-Tenant": "team-b"}, {})]

    assert anyio.run(main) == [200, 200]
    assert seen[1].startswith("key-")
    assert seen[0] == ("team-b" if trust else seen[1])


def test_the_trust_tenant_header_flag_reaches_the_settings():
    from asyncengine.entrypoints.cli import build_parser
    from asyncengine.entrypoints.flags.server import settings_from_args

    parser = build_parser()
    for argv, expected in ((["serve"], False), (["serve", "--trust-tenant-header"], True)):
        assert settings_from_args(parser.parse_args(argv)).trust_tenant_header is expected


def test_options_are_checked():
    config = EngineConfig.from_dict({**ENGINE, "scheduler": "fair-share"})
    for options, message in [({"weights": {"a": 0}}, "weight of 'a' must be a positive"),
                             ({"weights": [1]}, "'weights' must be an object"),
                             ({"default_weight": "x"}, "default_weight must be a positive"),
                             ({"weight": {}}, r"does not know \['weight'\]")]:
        with pytest.raises(ValueError, match=message):
            FairShareScheduler(config.replace(scheduler_config=options), 64)


def test_the_declared_entry_point_registers_fair_share():
    project = tomllib.loads((DIST / "pyproject.toml").read_text())
    value = project["project"]["entry-points"]["asyncengine"]["fair-share"]
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(importlib.metadata.EntryPoint("fair-share", value, "asyncengine").load(),
                name="fair-share")
    assert registered("schedulers", pm)["fair-share"] is FairShareScheduler
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="asyncengine")}
    if "fair-share" in installed:  # `make install` installs it (editable)
        assert installed["fair-share"] == value
