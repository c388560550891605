"""Multi-LoRA engine state and endpoints: adapters in /v1/models with their parent, 404
``model_not_found`` for unknown ones, runtime load/unload (refused unless enabled), the
prefix cache keyed by adapter, --max-loras per step, the CPU LRU, the lora_requests_info
gauge, and loading / unloading / eviction under load losing no request and leaking no
block."""

from __future__ import annotations

import json

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from asyncengine.config import EngineConfig
from asyncengine.core.kv.hashing import update_block_hashes
from asyncengine.core.request import LoRARequest, Request, RequestStatus
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.engine.engine import AsyncEngine
from asyncengine.engine.metrics import EngineMetrics
from asyncengine.entrypoints.http.app import build_app
from asyncengine.entrypoints.http.state import ServerSettings
from tests.cli.test_cli import run_cli
from tests.engine.test_lora import ADAPTERS, make_adapter
from tests.utils import make_tiny_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_serving")
    paths = {"base": make_tiny_model(root / "llama", "llama")}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        paths[name] = make_adapter(paths["base"], root / name, *spec, seed=20 + i)
    return paths


def test_adapter_requests_hash_apart_and_the_scheduler_keeps_max_loras():
    config = EngineConfig.from_dict({"enable_lora": True, "max_loras": 1, "block_size": 4,
                                     "max_num_seqs": 8, "max_num_batched_tokens": 64})
    a, b = LoRARequest("a", b"A" * 32, "/a"), LoRARequest("b", b"B" * 32, "/b")
    sp = SamplingParams(max_tokens=4)

    def req(rid: str, lora: LoRARequest | None) -> Request:
        r = Request(rid, list(range(8)), sp, max_model_len=64)
        r.lora = lora
        return r

    base, ra = req("base", None), req("a1", a)
    assert update_block_hashes(base, 4) != update_block_hashes(ra, 4)
    assert update_block_hashes(req("a2", a), 4) == ra.block_hashes
    sched = FCFSScheduler(config, 64)
    for r in (req("b0", None), req("a1", a), req("b1", b), req("a2", a)):
        sched.add_request(r)
    out = sched.schedule()
    # b1's adapter would be a second one: it waits, and a2 passes it
    assert sorted(s.request.request_id for s in out.scheduled) == ["a1", "a2", "b0"]
    assert [r.request_id for r in sched.waiting] == ["b1"]
    sched.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert "b1" in {s.request.request_id for s in out.scheduled}


def test_bad_lora_flags_exit_2_naming_the_flag(lora_models):
    for flags, name in ((["--max-loras", "0"], "--max-loras"),
                        (["--max-lora-rank", "1000"], "--max-lora-rank"),
                        (["--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
                        (["--lora-modules", "nopath"], "--lora-modules")):
        with pytest.raises(ValueError, match=name):
            EngineConfig.from_dict({"enable_lora": True, **{
                f[2:].replace("-", "_"): (int(v) if v.isdigit() else [v])
                for f, v in zip(flags[::2], flags[1::2], strict=True)}})
    r = run_cli("generate", "hi", "--model", lora_models["base"], "--enable-lora",
                "--max-loras", "0", timeout=120)
    assert r.returncode == 2 and "--max-loras" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="--lora-modules x: .*adapter_config.json"):
        AsyncEngine(EngineConfig.from_dict({
            "model": lora_models["base"], "dtype": "float32", "num_gpu_blocks_override": 8,
            "enable_lora": True, "lora_modules": [f"x={lora_models['base']}"]}))
    with pytest.raises(ValueError, match="--max-lora-rank 4"):
        AsyncEngine(EngineConfig.from_dict({
            "model": lora_models["base"], "dtype": "float32", "num_gpu_blocks_override": 8,
            "enable_lora": True, "max_lora_rank": 4,
            "lora_modules": [f"x={lora_models['all8']}"]}))


def test_endpoints_and_load_unload_eviction_under_load(lora_models, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": lora_models["base"], "served_model_name": ["base"], "dtype": "float32",
        "max_num_seqs": 16, "max_num_batched_tokens": 64, "block_size": 8,
        "num_gpu_blocks_override": 96, "max_model_len": 64, "enable_lora": True,
        "lora_modules": [f"qv4={lora_models['qv4']}",
                         json.dumps({"name": "all8", "path": lora_models["all8"],
                                     "base_model_name": "base"})],
        "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8}))
    engine.metrics = EngineMetrics(engine.model_name)
    app = build_app(engine, engine.metrics, ServerSettings())
    prompt = "The capital of France is Paris, and the capital of Germany is Berlin; so the " \
        "capital of"
    results: list[tuple[str, str, dict]] = []

    async def complete(client: TestClient, model: str, i: int) -> None:
        r = await client.post("/v1/completions", json={
            "model": model, "prompt": f"{prompt} {i // 3 % 2}", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})
        results.append((model, f"{i // 3 % 2}", await r.json()))

    async def main() -> None:
        async with engine, TestClient(TestServer(app)) as client:
            models = (await (await client.get("/v1/models")).json())["data"]
            assert [m["id"] for m in models] == ["base", "qv4", "all8"]
            assert [m["parent"] for m in models] == [None, "base", "base"]
            assert models[1]["root"] == lora_models["qv4"]
            r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            err = await r.json()
            assert r.status == 404 and err["error"]["code"] == "model_not_found"
            r = await client.post("/v1/load_lora_adapter", json={
                "lora_name": "mlp2", "lora_path": lora_models["mlp2"]})
            assert r.status == 404 and "--allow-runtime-lora-updating" in \
                (await r.json())["error"]["message"]
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            r = await client.post("/v1/load_lora_adapter", json={
                "lora_name": "bad", "lora_path": lora_models["base"]})
            assert r.status == 400 and "adapter_config.json" in \
                (await r.json())["error"]["message"]
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
            assert r.status == 404
            async with anyio.create_task_group() as tg:
                # under load: three adapters through one slot and one CPU entry
                for i in range(18):
                    tg.start_soon(complete, client, ["base", "qv4", "all8"][i % 3], i)
                await anyio.sleep(0.3)
                r = await client.post("/v1/load_lora_adapter", json={
                    "lora_name": "mlp2", "lora_path": lora_models["mlp2"]})
                assert r.status == 200, await r.text()
                r = await client.post("/v1/load_lora_adapter", json={
                    "lora_name": "mlp2", "lora_path": lora_models["mlp2"]})
                assert r.status == 400
                for i in range(6):
                    tg.start_soon(complete, client, "mlp2", i)
                metrics = await (await client.get("/metrics")).text()
                assert "vllm:lora_requests_info{" in metrics and 'max_lora="1"' in metrics
                await anyio.sleep(0.2)
                r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "qv4"})
                assert r.status == 200  # its queued requests still finish with it
            r = await client.post("/v1/completions", json={"model": "qv4", "prompt": "x"})
            assert r.status == 404
            models = (await (await client.get("/v1/models")).json())["data"]
            assert [m["id"] for m in models] == ["base", "all8", "mlp2"]

    anyio.run(main)
    assert len(results) == 24
    texts: dict[tuple[str, str], set[str]] = {}
    for model, p, body in results:
        choice = body["choices"][0]
        assert body["model"] == model and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 6
        texts.setdefault((model, p), set()).add(choice["text"])
    # greedy: one text per (adapter, prompt) whatever the slot churn; adapters differ
    assert all(len(v) == 1 for v in texts.values())
    assert len({next(iter(texts[m, "0"])) for m in ("base", "qv4", "all8", "mlp2")}) == 4
    assert engine.num_unfinished_requests == 0
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.lora.num_loads > 3  # the CPU LRU (one entry) read adapters again
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0  # same adapter and prompt: cached blocks reused
