"""Router mode in-process: several models in one app, routed by ``model``, loaded on demand,
unloaded LRU, listed with their status (``engine/registry.py``, ``entrypoints/http/router.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncengine.config import EngineConfig
from asyncengine.engine.catalog import build_catalog
from asyncengine.engine.registry import ModelRegistry
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
            memory_budget: int | None = None, sleep_mode: bool = False):
    """``body(client, registry)`` against a router app over ``models_dir``; afterwards every
    engine that was loaded had its block pool fully free."""
    sources = build_catalog(str(models_dir), {}, embedded=False)
    registry = ModelRegistry(sources, engine_factory(BASE, make_metrics), max_models=max_models,
                             autoload=autoload, memory_budget=memory_budget, drain_timeout=5)
    settings = ServerSettings(api_key=KEY, models_dir=str(models_dir), sleep_mode=sleep_mode)
    engines = []
    registry.on_loaded.append(engines.append)

    async def main():
        async with registry:
            app = build_app(None, None, settings, registry=registry)
            async with TestClient(TestServer(app)) as client:
                with anyio.fail_after(120):
                    result = await body(client, registry)
        for engine in engines:
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
