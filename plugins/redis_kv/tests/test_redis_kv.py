"""asyncengine-redis-kv against a real redis-server (Debian's redis-server package; the tests
skip, saying so, without it): a second, fresh server reads the first one's blocks and gives
the same answer, the prefill it saved visible in /metrics; eviction (a flushed store, TTLs)
costs recomputation only; a lost connection warns once, serves on, and reconnects; the vLLM
form of the configuration, kv_connector_module_path, and configuration errors."""

from __future__ import annotations

import importlib.metadata
import logging
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import tomllib

DIST = Path(__file__).resolve().parents[1]
if str(DIST) not in sys.path:  # run from a checkout without installing the distribution
    sys.path.insert(0, str(DIST))

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")

import asyncengine_redis_kv.plugin  # noqa: E402

from asyncengine import AsyncEngine  # noqa: E402
from asyncengine.plugins import (  # noqa: E402
    EngineConfig,
    SamplingParams,
    new_plugin_manager,
    registered,
)

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (apt-get install redis-server)")

BS = 16
ENGINE = {"dtype": "float32", "block_size": BS, "num_gpu_blocks_override": 64,
          "max_model_len": 256}
PROMPTS = [[random.Random(i).randrange(3, 40000) for _ in range(n)]
           for i, n in enumerate((50, 75))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server: no persistence, capped memory with LRU eviction."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.root), "--maxmemory", "64mb",
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        self.client = client

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def keys(self) -> list[bytes]:
        return list(self.client.scan_iter(match="asyncengine-kv:*"))


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path)
    s.start()
    yield s
    s.stop()


def plugin_manager():
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(asyncengine_redis_kv.plugin, name="redis")
    return pm


def redis_config(model: str, url: str, **extra) -> EngineConfig:
    return EngineConfig.from_dict({"model": model, **ENGINE, "kv_transfer_config": {
        "kv_connector": "redis", "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url, **extra}}})


async def serve(engine: AsyncEngine, prompts) -> tuple[list[str], float]:
    """Completions through the HTTP server; returns the texts and the
    external_prefix_cache_hits counter of /metrics (prompt tokens loaded, not computed)."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    texts = []
    async with engine:
        app = build_app(engine, EngineMetrics(engine.model_name), ServerSettings())
        async with TestClient(TestServer(app)) as c:
            for prompt in prompts:
                r = await c.post("/v1/completions", json={
                    "model": engine.model_name, "prompt": prompt, "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True})
                body = await r.json()
                assert r.status == 200, body
                texts.append(body["choices"][0]["text"])
            text = await (await c.get("/metrics")).text()
    hits = [line for line in text.splitlines()
            if line.startswith("vllm:external_prefix_cache_hits_total")]
    assert hits, "no external_prefix_cache_hits in /metrics"
    assert engine.num_free_blocks == engine.num_total_blocks
    return texts, float(hits[0].rsplit(" ", 1)[1])


async def generate(engine: AsyncEngine, prompts) -> tuple[list[list[int]], list[int]]:
    outs = []
    async with engine:
        for prompt in prompts:
            outs.append([o async for o in engine.generate(prompt, GREEDY)][-1])
    assert engine.num_free_blocks == engine.num_total_blocks
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def loadable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


def test_a_second_fresh_server_reads_the_first_ones_blocks(server, tiny_llama):
    pm = plugin_manager()
    config = redis_config(tiny_llama, server.url)
    first = AsyncEngine(config, plugin_manager=pm)
    texts, hits = anyio.run(serve, first, PROMPTS)
    assert hits == 0
    keys = server.keys()
    assert len(keys) >= sum(loadable(p) // BS for p in PROMPTS)
    assert all(k.decode().startswith(f"asyncengine-kv:{first.kv_transfer.connector.store}:")
               for k in keys)

    second = AsyncEngine(config, plugin_manager=pm)  # fresh: new cache, new connector
    again, hits = anyio.run(serve, second, PROMPTS)
    assert again == texts
    # (The first server computed every token, so its answer is the one without a store.)
    assert hits == sum(loadable(p) for p in PROMPTS)  # the prefill it did not compute


def test_eviction_costs_recomputation_only(server, tiny_llama):
    pm = plugin_manager()
    config = redis_config(tiny_llama, server.url, ttl=600)
    tokens, _ = anyio.run(generate, AsyncEngine(config, plugin_manager=pm), PROMPTS)
    assert all(0 < server.client.ttl(k) <= 600 for k in server.keys())

    second = AsyncEngine(config, plugin_manager=pm)  # it read the index of every block...
    keys = sorted(server.keys())
    server.client.delete(*keys[::2])  # ...then half are evicted
    again, cached = anyio.run(generate, second, PROMPTS)
    assert again == tokens
    assert all(c < loadable(p) for c, p in zip(cached, PROMPTS, strict=True))
    # The recomputed blocks were saved again: a third server finds them all.
    third = AsyncEngine(config, plugin_manager=pm)
    assert anyio.run(generate, third, PROMPTS) == (tokens, [loadable(p) for p in PROMPTS])


def test_a_lost_store_warns_once_serves_on_and_reconnects(server, tiny_llama, caplog):
    pm = plugin_manager()
    config = redis_config(tiny_llama, server.url, retry=0.2, timeout=0.5)
    engine = AsyncEngine(config, plugin_manager=pm)
    connector = engine.kv_transfer.connector
    fresh = [[random.Random(100 + i).randrange(3, 40000) for _ in range(40)] for i in range(4)]

    async def main() -> list[list[int]]:
        out = []
        async with engine:
            out.append([o async for o in engine.generate(fresh[0], GREEDY)][-1])
            server.stop()
            with caplog.at_level(logging.WARNING, logger="asyncengine.redis_kv"):
                for prompt in PROMPTS:  # served without the store
                    out.append([o async for o in engine.generate(prompt, GREEDY)][-1])
                await anyio.sleep(0.3)
                out.append([o async for o in engine.generate(fresh[1], GREEDY)][-1])
                server.start()
                await anyio.sleep(0.3)  # past the retry interval
                # fresh[2]'s lookup pings the store in the background (its own save may come
                # first and be dropped: the store is still marked down)
                out.append([o async for o in engine.generate(fresh[2], GREEDY)][-1])
                for _ in range(100):
                    if connector._down_since is None:
                        break
                    await anyio.sleep(0.1)
                saved = connector.num_saved_blocks
                out.append([o async for o in engine.generate(fresh[3], GREEDY)][-1])
                for _ in range(100):  # fresh[3]'s save, after the reconnection
                    if connector.num_saved_blocks > saved:
                        break
                    await anyio.sleep(0.1)
        return [o.outputs[0].token_ids for o in out]

    tokens = anyio.run(main)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    unreachable = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(unreachable) == 1, [r.getMessage() for r in caplog.records]
    assert any("is reachable again" in r.getMessage() for r in caplog.records)
    assert server.keys(), "nothing was saved after the reconnection"
    assert engine.num_free_blocks == engine.num_total_blocks


def test_configuration_the_vllm_way(server, tiny_llama):
    pm = plugin_manager()
    assert registered("kv_connectors", pm)["redis"].__name__ == "RedisKVConnector"
    by_module = EngineConfig.from_dict({"model": tiny_llama, **ENGINE, "kv_transfer_config": {
        "kv_connector": "RedisKVConnector",
        "kv_connector_module_path": "asyncengine_redis_kv.connector",
        "kv_connector_extra_config": {"url": server.url}}})
    assert by_module.plugins.kv_connector == "asyncengine_redis_kv.connector:RedisKVConnector"
    engine = AsyncEngine(by_module, plugin_manager=new_plugin_manager(load_entrypoints=False))
    assert type(engine.kv_transfer.connector).__name__ == "RedisKVConnector"

    for extra, message in [({}, 'needs "url"'), ({"url": "http://x"}, "redis url 'http://x'"),
                           ({"url": server.url, "ttl": 0}, "'ttl' must be a positive"),
                           ({"url": server.url, "host": "x"}, r"does not know \['host'\]")]:
        with pytest.raises(ValueError, match="--kv-transfer-config: .*" + message):
            AsyncEngine(redis_config(tiny_llama, "", **extra) if "url" not in extra else
                        EngineConfig.from_dict({"model": tiny_llama, **ENGINE,
                                                "kv_transfer_config": {
                                                    "kv_connector": "redis",
                                                    "kv_connector_extra_config": extra}}),
                        plugin_manager=pm)


def test_the_declared_entry_point_registers_redis():
    project = tomllib.loads((DIST / "pyproject.toml").read_text())
    value = project["project"]["entry-points"]["asyncengine"]["redis"]
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(importlib.metadata.EntryPoint("redis", value, "asyncengine").load(),
                name="redis")
    assert "redis" in registered("kv_connectors", pm)
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="asyncengine")}
    if "redis" in installed:  # `make install` installs it (editable)
        assert installed["redis"] == value
