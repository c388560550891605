"""The plugin system: hooks, entry points, the allowlist, name/qualname resolution, contracts.

Every test builds its own plugin manager; third-party plugins are installed by faking a
distribution (a ``*.dist-info`` directory with ``entry_points.txt``) on ``sys.path``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.interface import Scheduler
from asyncengine.engine.engine import AsyncEngine
from asyncengine.ext import registry
from asyncengine.ext.contracts.hooks import hookimpl
from asyncengine.ext.registry import new_plugin_manager, resolve_scheduler

SPF_PLUGIN = """
    from asyncengine.plugins import FCFSScheduler, hookimpl

    class SPFScheduler(FCFSScheduler):
        steps = 0

        def schedule(self):
            type(self).steps += 1
            return super().schedule()

    @hookimpl
    def register_schedulers(register):
        register("spf", SPFScheduler)
"""


class FakeSite:
    """Installs fake distributions, each with one module and one ``asyncengine`` entry
    point, into a directory put on ``sys.path`` for the duration of a test."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.modules: list[str] = []
        self.names: list[str] = []
        self.monkeypatch = monkeypatch
        monkeypatch.syspath_prepend(str(root))

    def install(self, ep_name: str, source: str, *, module: str | None = None) -> str:
        # Only the fake plugins load (not the distributions `make install` installed, such as
        # schedulers/*), so what a test sees does not depend on what else is installed.
        self.names.append(ep_name)
        self.monkeypatch.setenv(registry.ALLOWLIST_ENV, ",".join(self.names))
        module = module or f"fake_asyncengine_{ep_name}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        info = self.root / f"fake_{ep_name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-{ep_name}\n"
                                       "Version: 1.0\n")
        (info / "entry_points.txt").write_text(f"[asyncengine]\n{ep_name} = {module}\n")
        self.modules.append(module)
        return module

    def cleanup(self) -> None:
        for module in self.modules:
            sys.modules.pop(module, None)


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv(registry.ALLOWLIST_ENV, raising=False)
    (tmp_path / "site").mkdir()
    fake = FakeSite(tmp_path / "site", monkeypatch)
    yield fake
    fake.cleanup()


def test_builtins_are_registered_like_any_plugin():
    pm = new_plugin_manager(load_entrypoints=False)
    assert pm.get_plugin("builtins") is not None
    from asyncengine.core.sched import BUILTIN_SCHEDULERS

    schedulers = registry.registered("schedulers", pm)
    assert {"fcfs", "priority"} <= set(schedulers)
    for name, cls in BUILTIN_SCHEDULERS.items():
        assert resolve_scheduler(name, pm) is cls
    assert "LlamaForCausalLM" in registry.registered("models", pm)
    from asyncengine.builtins.xgrammar import XGrammarBackend

    assert registry.resolve_structured_output_backend("xgrammar", pm) is XGrammarBackend


def test_entry_point_plugin_registers_a_scheduler(site):
    module = site.install("spf", SPF_PLUGIN)
    pm = new_plugin_manager()
    assert pm.get_plugin("spf") is sys.modules[module]
    cls = resolve_scheduler("spf", pm)
    assert cls is sys.modules[module].SPFScheduler
    # Built-ins are still there, and still win their own names.
    assert "fcfs" in registry.registered("schedulers", pm)


def test_allowlist_selects_third_party_plugins(site, monkeypatch):
    site.install("spf", SPF_PLUGIN)
    site.install("other", "")

    monkeypatch.setenv(registry.ALLOWLIST_ENV, "other")
    pm = new_plugin_manager()
    assert pm.get_plugin("spf") is None and pm.get_plugin("other") is not None
    with pytest.raises(ValueError) as e:
        resolve_scheduler("spf", pm)
    assert "scheduler 'spf' is not registered" in str(e.value)
    assert "ASYNCENGINE_PLUGINS leaves them out: spf" in str(e.value)
    assert resolve_scheduler("fcfs", pm)  # built-ins always load

    monkeypatch.setenv(registry.ALLOWLIST_ENV, "")
    pm = new_plugin_manager()
    assert [name for name, _ in pm.list_name_plugin()] == ["builtins"]

    monkeypatch.setenv(registry.ALLOWLIST_ENV, " spf , ")
    assert "spf" in registry.registered("schedulers", new_plugin_manager())


def test_broken_plugin_is_skipped_and_named_when_needed(site, caplog):
    site.install("spf", "raise ImportError('spf needs numpy>=9')")
    with caplog.at_level(logging.WARNING, logger="asyncengine.ext.registry"):
        pm = new_plugin_manager()
    assert "plugin 'spf' failed to load: ImportError: spf needs numpy>=9" in caplog.text
    assert resolve_scheduler("fcfs", pm)  # the rest of the system is unaffected
    with pytest.raises(ValueError, match=r"--scheduler: scheduler 'spf' is not registered; "
                       r"plugin 'spf' failed to load: ImportError: spf needs numpy>=9") as e:
        resolve_scheduler("spf", pm)
    assert "(registered: fcfs, priority" in str(e.value)


def test_unknown_hook_name_refuses_the_plugin(site):
    site.install("typo", """
        from asyncengine.plugins import hookimpl

        @hookimpl
        def register_scheduler(register):
            pass
    """)
    pm = new_plugin_manager()
    assert pm.get_plugin("typo") is None
    [failure] = pm.failures
    assert failure.plugin == "typo" and "register_scheduler" in failure.error


def test_unknown_name_lists_the_registered_ones():
    pm = new_plugin_manager(load_entrypoints=False)
    with pytest.raises(ValueError, match=r"scheduler 'fifo' is not registered \(registered: "
                       r"fcfs, priority; or give pkg.module:Class\)"):
        resolve_scheduler("fifo", pm)
    with pytest.raises(ValueError, match="model architecture 'GPT2LMHeadModel' is not "
                       "supported"):
        registry.resolve_model("GPT2LMHeadModel", pm)
    with pytest.raises(ValueError, match="unknown component kind"):
        registry.registered("samplers", pm)


class Incomplete:
    """Duck-typed scheduler that forgot update_from_output."""

    def __init__(self, config, num_blocks):
        pass

    def add_request(self, request): ...
    def schedule(self): ...
    def finish_requests(self, request_ids, status): ...
    def has_unfinished_requests(self): ...
    def get_num_unfinished_requests(self): ...
    def reset_prefix_cache(self): ...
    def make_stats(self): ...
    def shutdown(self): ...


class Empty:
    pass


class DuckTyped(Incomplete):
    def update_from_output(self, scheduler_output, runner_output): ...


class FromTheFuture(DuckTyped):
    contract_version = 99


def test_qualname_is_checked_against_the_contract():
    here = __name__
    assert resolve_scheduler(f"{here}:DuckTyped") is DuckTyped  # subclassing is optional
    with pytest.raises(ValueError, match=rf"^--scheduler: {here}:Incomplete does not implement "
                       r"Scheduler.update_from_output$"):
        resolve_scheduler(f"{here}:Incomplete")
    with pytest.raises(ValueError, match="written for Scheduler version 99"):
        resolve_scheduler(f"{here}:FromTheFuture")
    with pytest.raises(ValueError, match="does not implement Scheduler.__init__, "
                       "Scheduler.add_request"):
        resolve_scheduler(f"{here}:Empty")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.sched' for "
                       "no_such_pkg.sched:S: ModuleNotFoundError"):
        resolve_scheduler("no_such_pkg.sched:S")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        resolve_scheduler(f"{here}:Nope")
    with pytest.raises(ValueError, match="is not a class"):
        resolve_scheduler(f"{here}:test_qualname_is_checked_against_the_contract")


def test_abstract_subclass_is_refused():
    class HalfDone(Scheduler):
        def __init__(self, config, num_blocks):
            pass

        def schedule(self): ...

    with pytest.raises(ValueError, match=r"does not implement Scheduler.add_request, "
                       r"Scheduler.update_from_output"):
        registry.check_contract("schedulers", HalfDone)


def test_registered_class_is_checked_too():
    class Plugin:
        @hookimpl
        def register_schedulers(self, register):
            register("half", Incomplete)

    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="half")
    with pytest.raises(ValueError, match=rf"scheduler 'half' \({__name__}:Incomplete\) "
                       "does not implement Scheduler.update_from_output"):
        resolve_scheduler("half", pm)


def test_models_never_resolve_a_qualname():
    pm = new_plugin_manager(load_entrypoints=False)
    with pytest.raises(ValueError, match="is not supported"):
        registry.resolve_model("os:system", pm)


def test_name_conflicts_and_failing_hooks_stay_contained(caplog):
    class Shadow:
        @hookimpl
        def register_schedulers(self, register):
            register("fcfs", DuckTyped)
            register("duck", DuckTyped)

    class Failing:
        @hookimpl
        def register_schedulers(self, register):
            register("never", DuckTyped)
            raise RuntimeError("boom")

    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(Shadow(), name="shadow")
    pm.register(Failing(), name="failing")
    with caplog.at_level(logging.WARNING, logger="asyncengine.ext.registry"):
        schedulers = registry.registered("schedulers", pm)
    from asyncengine.core.sched import BUILTIN_SCHEDULERS

    assert schedulers["fcfs"] is BUILTIN_SCHEDULERS["fcfs"]  # a plugin cannot replace it
    assert schedulers["duck"] is DuckTyped and "never" not in schedulers
    assert "already registered by plugin 'builtins'" in caplog.text
    assert "plugin 'failing' failed to register schedulers: RuntimeError: boom" in caplog.text
    with pytest.raises(ValueError, match="failed to register schedulers: RuntimeError: boom"):
        resolve_scheduler("never", pm)


def test_configure_time_hooks_receive_their_documented_arguments():
    calls = []

    class Plugin:
        @hookimpl
        def add_cli_arguments(self, parser, command):
            if command == "serve":
                parser.add_argument("--spf-max-skip", type=int, default=4)

        @hookimpl
        def register_http_routes(self, app, engine):
            calls.append((app, engine))

    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(Plugin())
    parser = argparse.ArgumentParser()
    pm.hook.add_cli_arguments(parser=parser, command="serve")
    assert parser.parse_args(["--spf-max-skip", "2"]).spf_max_skip == 2
    pm.hook.register_http_routes(app="app", engine="engine")
    assert calls == [("app", "engine")]


def test_process_wide_manager_loads_once(monkeypatch):
    monkeypatch.setattr(registry, "_global_pm", None)
    loads = []
    monkeypatch.setattr(registry, "_load_entrypoints", loads.append)
    pm = registry.get_plugin_manager()
    assert registry.get_plugin_manager() is pm and loads == [pm]
    assert "fcfs" in registry.registered("schedulers")


# -- through the engine --------------------------------------------------------------------

ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 8,
          "num_gpu_blocks_override": 64, "max_model_len": 128}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time, in a land far away, there lived a"]


async def greedy_tokens(engine: AsyncEngine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results: dict[int, list[int]] = {}

    async def one(i: int, prompt: str) -> None:
        outputs = [out async for out in engine.generate(prompt, params)]
        assert outputs[-1].finished
        results[i] = outputs[-1].outputs[0].token_ids

    async with engine, anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            tg.start_soon(one, i, prompt)
    return [results[i] for i in range(len(prompts))]


def test_entry_point_scheduler_drives_real_generation(site, tiny_llama):
    module = site.install("spf", SPF_PLUGIN)
    config = EngineConfig.from_dict({"model": tiny_llama, "scheduler": "spf", **ENGINE})
    engine = AsyncEngine(config, plugin_manager=new_plugin_manager())
    got = anyio.run(greedy_tokens, engine, PROMPTS)
    assert sys.modules[module].SPFScheduler.steps > 0  # it scheduled every step
    reference = AsyncEngine(config.replace(scheduler="fcfs"),
                            plugin_manager=new_plugin_manager(load_entrypoints=False))
    assert got == anyio.run(greedy_tokens, reference, PROMPTS)
    assert all(len(tokens) == 8 for tokens in got)


def test_engine_refuses_an_incomplete_scheduler_at_start_up(tiny_llama):
    config = EngineConfig.from_dict({"model": tiny_llama, "scheduler": f"{__name__}:Incomplete",
                                     **ENGINE})
    with pytest.raises(ValueError, match=f"{__name__}:Incomplete does not implement "
                       "Scheduler.update_from_output"):
        AsyncEngine(config, plugin_manager=new_plugin_manager(load_entrypoints=False))


class ComposedScheduler(Scheduler):
    """A third-party scheduler that wraps FCFS instead of subclassing it: it has no
    ``kv_cache_manager`` attribute, only the contract."""

    def __init__(self, config, num_blocks):
        from asyncengine.core.sched.fcfs import FCFSScheduler

        self._inner = FCFSScheduler(config, num_blocks)

    def add_request(self, request):
        self._inner.add_request(request)

    def schedule(self):
        return self._inner.schedule()

    def update_from_output(self, scheduler_output, runner_output):
        return self._inner.update_from_output(scheduler_output, runner_output)

    def finish_requests(self, request_ids, status):
        self._inner.finish_requests(request_ids, status)

    def has_unfinished_requests(self):
        return self._inner.has_unfinished_requests()

    def get_num_unfinished_requests(self):
        return self._inner.get_num_unfinished_requests()

    def reset_prefix_cache(self):
        return self._inner.reset_prefix_cache()

    def make_stats(self):
        return self._inner.make_stats()

    def shutdown(self):
        self._inner.shutdown()


def test_health_and_metrics_read_the_scheduler_contract_only(tiny_llama):
    """/health and /metrics take the free-block count from SchedulerStats, so a scheduler with
    no kv_cache_manager attribute serves them (and generates) like a built-in one."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE,
                                     "scheduler": f"{__name__}:ComposedScheduler"})
    engine = AsyncEngine(config, plugin_manager=new_plugin_manager(load_entrypoints=False))
    assert not hasattr(engine.scheduler, "kv_cache_manager")
    metrics = EngineMetrics(engine.model_name)

    async def main():
        async with engine:
            app = build_app(engine, metrics, ServerSettings())
            async with TestClient(TestServer(app)) as c:
                r = await c.post("/v1/completions", json={
                    "model": engine.model_name, "prompt": "hello", "max_tokens": 4,
                    "temperature": 0})
                assert r.status == 200, await r.text()
                health = await c.get("/health")
                text = await (await c.get("/metrics")).text()
                return health.status, await health.json(), text

    status, health, text = anyio.run(main)
    assert status == 200
    assert health["num_total_blocks"] > 0
    assert health["num_free_blocks"] == health["num_total_blocks"]
    total = [line for line in text.splitlines()
             if line.startswith("asyncengine:kv_cache_total_blocks{")]
    assert total and float(total[0].rsplit(" ", 1)[1]) == health["num_total_blocks"]


def test_built_in_schedulers_take_no_options(tiny_llama):
    config = EngineConfig.from_dict({"model": tiny_llama, **ENGINE,
                                     "scheduler_config": '{"max_skips": 3}'})
    with pytest.raises(ValueError, match=r"--scheduler-config: the built-in scheduler 'fcfs' "
                       r"takes no options \(got \['max_skips'\]\)"):
        AsyncEngine(config, plugin_manager=new_plugin_manager(load_entrypoints=False))
