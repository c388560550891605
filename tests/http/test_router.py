"""Router mode in-process: several models in one app, routed by ``model``, loaded on demand,
unloaded LRU, listed with their status (``engine/registry.py``, ``entrypoints/http/router.py``)."""

from __future__ import annotations

import contextlib
import json
import shutil
import weakref
from pathlib import Path

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncengine.config import EngineConfig
from asyncengine.engine.catalog import build_catalog
from asyncengine.engine.registry import ModelRegistry
from asyncengine.entrypoints.batch.service import batch_jobs
from asyncengine.entrypoints.http.app import build_app
from asyncengine.entrypoints.http.router_server import engine_factory
from asyncengine.entrypoints.http.server import make_metrics
from asyncengine.entrypoints.http.state import ServerSettings

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = EngineConfig.from_dict({"dtype": "float32", "num_gpu_blocks_override": 64,
                               "max_model_len": 256})


@pytest.fixture(scope="module")
def models_dir(tiny_models, tmp_path_factory) -> Path:
    """llama (a checkpoint directory), qwen2 (one more), a corrupt GGUF, an empty folder,
    and a symlink out of the directory."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_models["llama"], root / "llama")
    shutil.copytree(tiny_models["qwen2"], root / "qwen2")
    (root / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 60)
    (root / "empty").mkdir()
    (root / "outside").symlink_to(tiny_models["qwen3"])
    return root


def run_app(models_dir: Path, body, *, max_models: int = 4, autoload: bool = True,
            memory_budget: int | None = None, sleep_mode: bool = False, sources=None,
            sleep_idle_s: float | None = None, drain_timeout: float = 5,
            batches: bool = False):
    """``body(client, registry)`` against a router app over ``models_dir``; afterwards every
    engine still alive (and not failed) has its block pool fully free. ``batches``: the Batch
    API's jobs run (in a temporary directory), as ``serve`` runs them."""
    sources = sources or build_catalog(str(models_dir), {}, embedded=False)
    registry = ModelRegistry(sources, engine_factory(BASE, make_metrics), max_models=max_models,
                             autoload=autoload, memory_budget=memory_budget,
                             drain_timeout=drain_timeout,
                             sleep_idle_s=sleep_idle_s)
    settings = ServerSettings(api_key=KEY, models_dir=str(models_dir), sleep_mode=sleep_mode)
    engines = []  # weak references: an unloaded engine must be freed
    registry.on_loaded.append(lambda engine: engines.append(weakref.ref(engine)))

    async def main():
        async with registry:
            app = build_app(None, None, settings, registry=registry)
            async with contextlib.AsyncExitStack() as jobs:
                if batches:
                    await jobs.enter_async_context(batch_jobs(app, 8))
                async with TestClient(TestServer(app)) as client:
                    with anyio.fail_after(120):
                        result = await body(client, registry)
        for ref in engines:
            engine = ref()
            if engine is None or engine.error is not None:  # freed, or failed as it was
                continue
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        return result

    return anyio.run(main)


async def status_of(client) -> dict[str, str]:
    r = await client.get("/models", headers=AUTH)
    assert r.status == 200
    return {m["id"]: m["status"]["value"] for m in (await r.json())["data"]}


async def complete(client, model: str | None, prompt: str = "Hello there", n: int = 6):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    if model is not None:
        body["model"] = model
    return await client.post("/v1/completions", json=body, headers=AUTH)


def test_requests_route_by_model_and_load_on_demand(models_dir):
    """Each route family picks the engine by `model`; a model loads on its first request and
    the others stay unloaded; /health, /metrics and /v1/models say so."""

    async def body(client, registry):
        assert await status_of(client) == {"broken": "unloaded", "llama": "unloaded",
                                           "qwen2": "unloaded"}
        first = await complete(client, "llama")
        assert first.status == 200, await first.text()
        llama = await first.json()
        statuses = await status_of(client)
        assert statuses["llama"] == "loaded" and statuses["qwen2"] == "unloaded"
        msg = await client.post("/v1/messages", headers=AUTH, json={
            "model": "qwen2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert msg.status == 200, await msg.text()
        assert (await msg.json())["model"] == "qwen2"
        native = await client.post("/completion", headers=AUTH, json={
            "model": "llama", "prompt": "Hello there", "n_predict": 6, "temperature": 0})
        assert native.status == 200
        assert (await native.json())["content"] == llama["choices"][0]["text"]
        health = await (await client.get("/health")).json()
        assert sorted(health["loaded"]) == ["llama", "qwen2"]
        text = await (await client.get("/metrics")).text()
        assert 'vllm:generation_tokens_total{engine="0",model_name="llama"}' in text
        assert 'model_name="qwen2"' in text
        assert text.count("# TYPE vllm:generation_tokens_total counter") == 1
        models = await (await client.get("/v1/models", headers=AUTH)).json()
        assert {m["id"] for m in models["data"]} >= {"llama", "qwen2"}
        card = next(m for m in models["data"] if m["id"] == "llama")  # OpenAI's fields too
        assert card["object"] == "model" and card["owned_by"] == "asyncengine"
        assert card["status"] == {"value": "loaded"} and card["max_model_len"] == 256
        return llama

    llama = run_app(models_dir, body)
    assert llama["model"] == "llama"


def test_bad_names_and_paths_are_clear_errors(models_dir):
    async def body(client, registry):
        unknown = await complete(client, "nope")
        assert unknown.status == 404
        err = (await unknown.json())["error"]
        assert err["code"] == "model_not_found" and "`llama`" in err["message"]
        anthropic = await client.post("/v1/messages", headers=AUTH, json={
            "model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
        assert anthropic.status == 404
        assert (await anthropic.json())["error"]["type"] == "not_found_error"
        missing = await complete(client, None)
        assert missing.status == 400 and "model is required" in await missing.text()
        for path in ("../llama", "/etc/passwd", "outside", "llama/../../x"):
            r = await client.post("/models/load", json={"model": path}, headers=AUTH)
            assert r.status in (400, 404), (path, r.status)
            assert "outside" in await r.text() or "leaves" in await r.text() or \
                "not a path" in await r.text() or r.status == 404
        r = await client.post("/models/load", json={"model": "empty"}, headers=AUTH)
        assert r.status == 400 and "holds no model" in await r.text()
        assert (await client.post("/models/load", json={"model": "llama"})).status == 401
        broken = await complete(client, "broken")
        assert broken.status == 500
        message = (await broken.json())["error"]["message"]
        assert "broken.gguf" in message
        assert (await status_of(client))["broken"] == "failed"
        again = await complete(client, "broken")  # a later request tries again
        assert again.status == 500
        assert (await complete(client, "llama")).status == 200  # the others serve
        return True

    assert run_app(models_dir, body)


def test_a_model_loads_once_and_others_never_wait_for_it(models_dir):
    """Four requests for a model that is loading share one load; a loaded model answers
    meanwhile."""
    import threading

    gate = threading.Event()
    calls: list[str] = []
    make = engine_factory(BASE, make_metrics)

    def slow_make(source):
        calls.append(source.name)
        if source.name == "qwen2":
            gate.wait(60)
        return make(source)

    async def body(client, registry):
        registry.make_engine = slow_make
        assert (await complete(client, "llama")).status == 200
        results = []

        async def one():
            results.append((await complete(client, "qwen2")).status)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)
            await anyio.sleep(0.3)
            assert (await status_of(client))["qwen2"] == "loading"
            assert (await complete(client, "llama")).status == 200  # not behind qwen2
            gate.set()
        assert results == [200] * 4
        return calls

    assert run_app(models_dir, body) == ["llama", "qwen2"]


def test_unload_while_streaming_lets_the_stream_finish(models_dir):
    async def body(client, registry):
        r = await client.post("/v1/completions", headers=AUTH, json={
            "model": "llama", "prompt": "Once", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True})
        assert r.status == 200
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        unload = await client.post("/models/unload", json={"model": "llama"}, headers=AUTH)
        rest = await r.read()
        assert b'"finish_reason":"length"' in rest and rest.rstrip().endswith(b"[DONE]")
        assert unload.status == 200
        assert (await status_of(client))["llama"] == "unloaded"
        assert registry.entries["llama"].engine is None
        return True

    assert run_app(models_dir, body)


def test_models_max_1_serves_two_models_in_turns(models_dir):
    """LRU by count: with one slot, each model unloads the other; requests in turns and at
    once all succeed with the tokens each model gives alone."""

    async def body(client, registry):
        texts: dict[str, set[str]] = {"llama": set(), "qwen2": set()}

        async def one(model):
            r = await complete(client, model)
            assert r.status == 200, await r.text()
            texts[model].add((await r.json())["choices"][0]["text"])

        for model in ("llama", "qwen2", "llama", "qwen2"):
            await one(model)
            statuses = await status_of(client)
            assert [m for m, s in statuses.items() if s == "loaded"] == [model]
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, ("llama", "qwen2")[i % 2])
        assert all(len(v) == 1 for v in texts.values()), texts
        return True

    assert run_app(models_dir, body, max_models=1)


def test_a_memory_budget_too_small_refuses_the_load(models_dir):
    async def body(client, registry):
        r = await complete(client, "llama")
        assert r.status == 503
        assert "--models-memory" in (await r.json())["error"]["message"]
        assert (await status_of(client))["llama"] == "failed"
        return True

    assert run_app(models_dir, body, memory_budget=1 << 20)


def test_without_autoload_models_load_by_request(models_dir):
    async def body(client, registry):
        r = await complete(client, "llama")
        assert r.status == 400 and "/models/load" in await r.text()
        loaded = await client.post("/models/load", json={"model": "llama"}, headers=AUTH)
        assert loaded.status == 200
        assert (await loaded.json())["model"]["status"]["value"] == "loaded"
        assert (await complete(client, "llama")).status == 200
        return True

    assert run_app(models_dir, body, autoload=False)


def test_a_failed_engine_ends_alone_and_loads_again(models_dir):
    broken = []

    def breaker(engine):
        if engine.model_name == "qwen2" and not broken:
            def execute(inputs):
                raise RuntimeError("device fell over")

            engine.runner.execute = execute
            broken.append(engine)

    async def body(client, registry):
        registry.on_loaded.append(breaker)
        assert (await complete(client, "llama")).status == 200
        r = await complete(client, "qwen2")
        assert r.status == 500 and "device fell over" in await r.text()
        for _ in range(100):
            if (await status_of(client))["qwen2"] == "failed":
                break
            await anyio.sleep(0.05)
        models = (await (await client.get("/models", headers=AUTH)).json())["data"]
        qwen2 = next(m for m in models if m["id"] == "qwen2")
        assert qwen2["status"]["value"] == "failed"
        assert "device fell over" in qwen2["status"]["error"]
        assert (await complete(client, "llama")).status == 200
        assert (await complete(client, "qwen2")).status == 200  # loaded again
        return True

    assert run_app(models_dir, body)


def test_sleep_levels_free_memory_and_a_request_wakes_the_model(models_dir):
    async def body(client, registry):
        before = await (await complete(client, "llama")).json()
        entry = registry.entries["llama"]
        loaded_bytes = entry.memory
        r = await client.post("/sleep?level=1&model=llama", headers=AUTH)
        assert r.status == 200
        assert entry.status == "sleeping" and entry.sleep_level == 1
        assert entry.engine is not None and entry.engine.runner.kv_caches == []
        assert entry.memory < loaded_bytes
        assert (await (await client.get("/is_sleeping?model=llama", headers=AUTH)).json())[
            "is_sleeping"] is True
        woken = await (await complete(client, "llama")).json()
        assert woken["choices"] == before["choices"] and entry.status == "loaded"
        assert (await client.post("/sleep?level=2", headers=AUTH)).status == 200
        assert entry.status == "sleeping" and entry.sleep_level == 2 and entry.engine is None
        assert (await client.post("/wake_up?model=llama", headers=AUTH)).status == 200
        assert entry.status == "loaded"
        again = await (await complete(client, "llama")).json()
        assert again["choices"] == before["choices"]
        bad = await client.post("/sleep?level=3", headers=AUTH)
        assert bad.status == 400
        assert (await client.post("/sleep?level=1")).status == 401
        return True

    assert run_app(models_dir, body, sleep_mode=True)


@pytest.mark.parametrize("argv, flag", [
    (["--models-dir", "/nonexistent/models"], "--models-dir"),
    (["some-model", "--models-dir", "."], "--models-dir"),
    (["--models-dir", ".", "--models-max", "-1"], "--models-max"),
    (["--models-dir", ".", "--models-memory", "lots"], "--models-memory"),
    (["--enable-sleep-mode", "--sleep-idle-seconds", "0"], "--sleep-idle-seconds"),
    (["--models-preset", "/nonexistent.ini"], "--models-preset"),
    (["--models-dir", ".", "--models-unload-timeout", "-1"], "--models-unload-timeout"),
])
def test_bad_router_flags_exit_2_naming_the_flag(argv, flag, capsys):
    from asyncengine.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_presets_in_ini_and_yaml_set_aliases_and_options(models_dir, tmp_path):
    from asyncengine.config.models_preset import load_presets

    ini = tmp_path / "models.ini"
    ini.write_text("version = 1\n[*]\nc = 128\nn-gpu-layers = 99\n"
                   "[llama]\nalias = small, tiny-chat\nload-on-startup = true\n"
                   "[renamed]\nmodel = qwen2\nctx-size = 64\n")
    yaml_file = tmp_path / "models.yaml"
    yaml_file.write_text("llama:\n  alias: [small, tiny-chat]\n  max-model-len: 128\n"
                         "renamed:\n  model: qwen2\n  max_model_len: 64\n")
    for path in (ini, yaml_file):
        presets = load_presets(path)
        assert presets["llama"].aliases == ["small", "tiny-chat"]
        assert presets["llama"].options == {"max_model_len": 128}
        assert presets["renamed"].model == "qwen2"
        assert presets["renamed"].options == {"max_model_len": 64}
    assert load_presets(ini)["llama"].load_on_startup
    sources = {s.name: s for s in build_catalog(str(models_dir), load_presets(ini), False)}
    assert sources["renamed"].path == str(models_dir / "qwen2")
    (tmp_path / "escape.ini").write_text("[x]\nmodel = ../../etc\n")
    with pytest.raises(ValueError, match="--models-preset: \\[x\\].*leaves"):
        build_catalog(str(models_dir), load_presets(tmp_path / "escape.ini"), False)
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="--models-preset"):
        load_presets(tmp_path / "bad.yaml")


def test_an_alias_routes_to_its_model_with_its_preset(models_dir, tmp_path):
    from asyncengine.config.models_preset import load_presets
    from asyncengine.entrypoints.flags.router import RouterSettings
    from asyncengine.entrypoints.http.router_server import catalog

    ini = tmp_path / "models.ini"
    ini.write_text("[llama]\nalias = tiny-chat\nc = 128\n")
    sources = catalog(BASE, RouterSettings(models_dir=str(models_dir), models_preset=str(ini)))
    assert {s.name for s in sources} == {"llama", "qwen2", "broken", "default"}
    (tmp_path / "typo.ini").write_text("[llama]\nmax-num-sqes = 4\n")
    with pytest.raises(ValueError, match="--models-preset: \\[llama\\]"):
        catalog(BASE, RouterSettings(models_dir=str(models_dir),
                                     models_preset=str(tmp_path / "typo.ini")))
    presets = load_presets(ini)

    async def body(client, registry):
        r = await complete(client, "tiny-chat")
        assert r.status == 200 and (await r.json())["model"] == "llama"
        card = await (await client.get("/v1/models/tiny-chat", headers=AUTH)).json()
        assert card["id"] == "llama" and card["aliases"] == ["tiny-chat"]
        assert card["max_model_len"] == 128
        return True

    assert run_app(models_dir, body, sources=build_catalog(str(models_dir), presets, False))


def test_the_offline_api_holds_several_models(models_dir):
    from asyncengine import LLMs, SamplingParams

    models = LLMs(models_dir=str(models_dir), max_models=1, dtype="float32",
                  num_gpu_blocks_override=64, max_model_len=256)
    params = SamplingParams(max_tokens=5, temperature=0)
    try:
        llama = models.generate("llama", "Hello there", params)[0].outputs[0].text
        assert models.loaded == ["llama"]
        qwen2 = models.generate("qwen2", ["Hello there"], params)[0].outputs[0].text
        assert models.loaded == ["qwen2"]  # max_models=1: llama was unloaded
        assert models.generate("llama", "Hello there", params)[0].outputs[0].text == llama
        assert qwen2 != llama
        models.unload("llama")
        assert models.loaded == []
        with pytest.raises(LookupError, match="available"):
            models.load("nope")
    finally:
        models.close()


def test_three_models_at_c16_give_the_tokens_each_gives_alone(models_dir):
    """The embedded model and two tiny ones in one server, requested in a mix at c=16, give
    the greedy tokens of each model served alone."""
    from asyncengine import LLMs, SamplingParams

    names = ("default", "llama", "qwen2")
    prompts = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(6)]
    alone = LLMs({"default": None, "llama": str(models_dir / "llama"),
                  "qwen2": str(models_dir / "qwen2")}, max_models=1, dtype="float32",
                 num_gpu_blocks_override=64, max_model_len=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        expected = {(n, p): list(o.outputs[0].token_ids) for n in names
                    for p, o in zip(prompts, alone.generate(n, prompts, params), strict=True)}
    finally:
        alone.close()
    sources = [s for s in build_catalog(str(models_dir), {}, embedded=True)
               if s.name in names]

    async def body(client, registry):
        got = {}
        limit = anyio.Semaphore(16)

        async def one(name, prompt):
            async with limit:
                r = await client.post("/completion", headers=AUTH, json={
                    "model": name, "prompt": prompt, "n_predict": 8, "temperature": 0,
                    "ignore_eos": True, "return_tokens": True})
                assert r.status == 200, await r.text()
                got[(name, prompt)] = (await r.json())["tokens"]

        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                for name in names:
                    tg.start_soon(one, name, prompt)
        return got

    assert run_app(models_dir, body, sources=sources) == expected


def test_an_idle_model_sleeps_by_itself_and_the_documents_list_the_routes(models_dir):
    """--sleep-idle-seconds: an idle model sleeps at level 1, a request wakes it; the page's
    config and /openapi.json answer in router mode."""

    async def body(client, registry):
        assert (await complete(client, "llama")).status == 200
        entry = registry.entries["llama"]
        for _ in range(100):
            if entry.status == "sleeping":
                break
            await anyio.sleep(0.05)
        assert entry.status == "sleeping" and entry.sleep_level == 1
        assert (await complete(client, "llama")).status == 200
        assert entry.status == "loaded"
        doc = await (await client.get("/openapi.json", headers=AUTH)).json()
        assert {"/models", "/models/load", "/models/unload", "/sleep", "/wake_up",
                "/is_sleeping", "/v1/chat/completions"} <= set(doc["paths"])
        assert {"/v1/batches", "/v1/files"} <= set(doc["paths"])
        page = await client.get("/webui/config")
        assert page.status == 200
        return True

    assert run_app(models_dir, body, sleep_mode=True, sleep_idle_s=0.5)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_load_unload_cycles_under_load_lose_nothing_and_give_memory_back(models_dir):
    """qwen2 loaded and unloaded in turns while llama streams: every request ends whole, no
    block is left taken, every unloaded engine is freed and the resident set stops growing."""
    import gc

    async def body(client, registry):
        stop = anyio.Event()
        done, bad = [0], []

        async def stream():
            while not stop.is_set():
                r = await client.post("/v1/completions", headers=AUTH, json={
                    "model": "llama", "prompt": "Once", "max_tokens": 12, "stream": True})
                raw = await r.read()
                if r.status != 200 or not raw.rstrip().endswith(b"[DONE]") or b'"error"' in raw:
                    bad.append(raw[-300:])
                done[0] += 1

        rss, freed = [], []
        registry.on_loaded.append(
            lambda e: freed.append(weakref.ref(e)) if e.model_name == "qwen2" else None)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(stream)
            for _ in range(6):
                assert (await complete(client, "qwen2")).status == 200
                r = await client.post("/models/unload", json={"model": "qwen2"}, headers=AUTH)
                assert r.status == 200
                gc.collect()
                rss.append(_rss_mib())
            stop.set()
        assert not bad and done[0] > 3  # (each stream ends the request it has at the stop)
        assert len(freed) == 6 and all(ref() is None for ref in freed)  # no engine lingers
        return rss

    rss = run_app(models_dir, body)
    # The first cycles leave one-time imports and caches; after them it must not grow (a
    # leaked engine of this model would add ~40 MiB a cycle).
    assert max(rss[2:]) <= rss[1] * 1.08 + 16, rss


def test_a_client_leaving_during_a_load_does_not_stop_it(models_dir):
    import threading

    import aiohttp

    gate = threading.Event()
    make = engine_factory(BASE, make_metrics)

    calls = []

    def slow_make(source):
        calls.append(source.name)
        gate.wait(60)
        return make(source)

    async def body(client, registry):
        registry.make_engine = slow_make
        with pytest.raises((aiohttp.ClientError, TimeoutError)):  # it gives up while loading
            await client.post("/v1/completions", headers=AUTH, timeout=aiohttp.ClientTimeout(
                total=0.5), json={"model": "qwen2", "prompt": "hi", "max_tokens": 2})
        assert registry.entries["qwen2"].status == "loading"
        gate.set()
        r = await complete(client, "qwen2")
        assert r.status == 200
        assert registry.entries["qwen2"].status == "loaded"
        return calls

    assert run_app(models_dir, body) == ["qwen2"]  # the first load was not abandoned


def test_each_models_preset_lora_adapters_route_to_that_model(models_dir, tmp_path):
    """Adapters of each model's preset (lora-modules) are names requests may use: one loads
    its model, which serves it with that model's LoRA manager; an adapter is keyed to its
    model alone, and a name two models' presets both give is refused at start-up."""
    pytest.importorskip("peft")
    from asyncengine.config.models_preset import load_presets
    from asyncengine.entrypoints.flags.router import RouterSettings
    from asyncengine.entrypoints.http.router_server import catalog
    from tests.engine.test_lora import ADAPTERS, make_adapter

    adapters = {m: make_adapter(str(models_dir / m), tmp_path / m, *ADAPTERS["qv4"], seed=3)
                for m in ("llama", "qwen2")}
    ini = tmp_path / "models.ini"
    ini.write_text(f"[llama]\nenable-lora = true\nlora-modules = qv4={adapters['llama']}\n"
                   f"[qwen2]\nenable-lora = true\nlora-modules = q2={adapters['qwen2']}\n")
    sources = build_catalog(str(models_dir), load_presets(ini), False)
    clash = tmp_path / "clash.ini"
    clash.write_text(ini.read_text().replace("q2=", "qv4="))
    with pytest.raises(ValueError, match="--models-preset: \\[qwen2\\].*'qv4'.*\\[llama\\]"):
        catalog(BASE, RouterSettings(models_dir=str(models_dir), models_preset=str(clash)))

    async def body(client, registry):
        base = {m: (await (await complete(client, m)).json())["choices"][0]["text"]
                for m in ("llama", "qwen2")}
        for adapter, model in (("qv4", "llama"), ("q2", "qwen2")):
            r = await complete(client, adapter)
            assert r.status == 200, await r.text()
            got = await r.json()
            assert got["model"] == adapter and got["choices"][0]["text"] != base[model]
            assert registry.entries[model].engine.lora_names() == [adapter]
        unknown = await complete(client, "nope")
        assert "`qv4`" in (await unknown.json())["error"]["message"]
        models = (await (await client.get("/v1/models", headers=AUTH)).json())["data"]
        parents = {m["id"]: m.get("parent") for m in models}
        assert parents["qv4"] == "llama" and parents["q2"] == "qwen2"
        return True

    assert run_app(models_dir, body, sources=sources)


def test_sleep_mode_on_one_model_serves_it_under_its_names(tmp_path, caplog):
    from asyncengine.entrypoints.flags.router import RouterSettings
    from asyncengine.entrypoints.http.router_server import catalog

    config = BASE.replace(model="/some/model", served_model_name=["a", "b"])
    (source,) = catalog(config, RouterSettings(sleep_mode=True))
    assert (source.name, source.path, source.aliases) == ("a", "/some/model", ["b"])
    (embedded,) = catalog(BASE, RouterSettings(sleep_mode=True))
    assert embedded.path is None and embedded.name == "SmolLM2-135M-Instruct"
    (alone,) = catalog(BASE, RouterSettings(models_dir=str(tmp_path)))  # an empty directory
    assert alone.name == "default" and "no models in" in caplog.text


def test_an_unloaded_engine_is_freed_at_once_without_a_collection(models_dir, caplog):
    """With the collector off, the unloaded engine (its weights, its KV cache) is gone as soon
    as the unload has answered: nothing keeps it in a reference cycle (engine/cycles.py), so
    no full collection stalls the other models. Requests of every kind ran on it first, and
    with --models-unload-timeout 0 a running stream ends at once with an error naming the
    unloaded model."""
    import gc

    async def body(client, registry):
        refs = []
        registry.on_loaded.append(lambda e: refs.append(weakref.ref(e)))
        assert (await complete(client, "llama")).status == 200
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", headers=AUTH, json={
                "model": "llama", "max_tokens": 4, "stream": stream,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status == 200 and await r.read()
        r = await client.post("/v1/messages", headers=AUTH, json={
            "model": "llama", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200 and await r.read()
        r = await client.post("/v1/completions", headers=AUTH, json={
            "model": "llama", "prompt": "Once", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True})
        assert (await r.content.readline()).startswith(b"data: ")
        gc.collect()
        gc.disable()
        try:
            unload = await client.post("/models/unload", json={"model": "llama"},
                                       headers=AUTH)
            rest = await r.read()
            assert unload.status == 200
            assert rest.rstrip().endswith(b"[DONE]"), rest[-300:]
            error = json.loads(rest.split(b"data: ")[-2])["error"]
            assert error["code"] == "model_unloaded" and "`llama` was unloaded" in \
                error["message"] and "shutting down" not in error["message"]
            for _ in range(50):  # (a handler may be finishing its response)
                if refs[0]() is None:
                    break
                await anyio.sleep(0.01)
            assert refs[0]() is None
        finally:
            gc.enable()
        assert "garbage collection" not in caplog.text
        return True

    assert run_app(models_dir, body, drain_timeout=0)


def test_a_model_added_after_start_loads_by_its_path(models_dir, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(models_dir / "llama", root / "llama")

    async def body(client, registry):
        shutil.copytree(models_dir / "qwen2", root / "late" / "qwen2")
        r = await client.post("/models/load", json={"model": "late/qwen2"}, headers=AUTH)
        assert r.status == 200, await r.text()
        assert (await r.json())["model"]["id"] == "late/qwen2"
        assert (await complete(client, "late/qwen2")).status == 200
        again = await client.post("/models/load", json={"model": "late/qwen2"}, headers=AUTH)
        assert again.status == 200 and len(registry.entries) == 2
        return True

    assert run_app(root, body)


def test_a_batch_routes_each_line_to_its_model(models_dir):
    """The Batch API in router mode: each line's ``model`` picks its engine, loaded on demand
    as for a request; an unknown model is that line's error, the others go on; each answer is
    the one the same request gets alone."""
    import aiohttp

    models = ["llama", "qwen2", "llama", "nope", "qwen2"]
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": f"Hello {i}", "max_tokens": 5, "temperature": 0}}
             for i, m in enumerate(models)]

    async def body(client, registry):
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", "".join(json.dumps(line) + "\n" for line in lines).encode(),
                       filename="in.jsonl")
        up = await client.post("/v1/files", data=form, headers=AUTH)
        assert up.status == 200, await up.text()
        r = await client.post("/v1/batches", headers=AUTH, json={
            "input_file_id": (await up.json())["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"})
        assert r.status == 200, await r.text()
        batch = await r.json()
        assert set((await status_of(client)).values()) == {"unloaded"}
        while batch["status"] not in ("completed", "failed"):
            await anyio.sleep(0.05)
            batch = await (await client.get(f"/v1/batches/{batch['id']}", headers=AUTH)).json()
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
        out = {}
        for key in ("output_file_id", "error_file_id"):
            text = await (await client.get(f"/v1/files/{batch[key]}/content",
                                           headers=AUTH)).text()
            out.update((o["custom_id"], o) for o in map(json.loads, text.splitlines()))
        failed = out.pop("line-3")
        assert failed["error"]["code"] == "model_not_found"
        assert failed["response"]["status_code"] == 404
        for i, m in enumerate(models):
            if m == "nope":
                continue
            got = out[f"line-{i}"]["response"]
            alone = await (await complete(client, m, f"Hello {i}", 5)).json()
            assert got["status_code"] == 200 and got["body"]["model"] == m
            assert got["body"]["choices"][0]["text"] == alone["choices"][0]["text"]
        return True

    assert run_app(models_dir, body, batches=True)

