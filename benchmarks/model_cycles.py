"""Load/unload cycles of one model of a router while another streams (docs/benchmarks.md,
"Several models in one server"): per cycle the time to load it and answer two requests, the
time to unload it, and the resident set after the unload; at the end, the streamed requests
that failed (none should) and the streaming model's free blocks. In-process (aiohttp's test
server over a ``ModelRegistry``). Usage:

    PYTHONPATH=. python benchmarks/model_cycles.py MODELS_DIR [--cycles 20] [--model default]
        [--streaming tiny] [--streams 4]
"""

from __future__ import annotations

import argparse
import gc
import time

import anyio


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run(args: argparse.Namespace) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.config import EngineConfig
    from asyncengine.engine.catalog import build_catalog
    from asyncengine.engine.registry import ModelRegistry
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.router_server import engine_factory
    from asyncengine.entrypoints.http.server import make_metrics
    from asyncengine.entrypoints.http.state import ServerSettings

    base = EngineConfig.from_dict({"dtype": "float32", "num_gpu_blocks_override": 64,
                                   "max_model_len": 256})
    registry = ModelRegistry(build_catalog(args.models_dir, {}, embedded=True),
                             engine_factory(base, make_metrics), drain_timeout=5)
    async with registry:
        app = build_app(None, None, ServerSettings(models_dir=args.models_dir),
                        registry=registry)
        async with TestClient(TestServer(app)) as client:
            stop, done, bad = anyio.Event(), [0], []

            async def stream() -> None:
                while not stop.is_set():
                    r = await client.post("/v1/completions", json={
                        "model": args.streaming, "prompt": "hi", "max_tokens": 16,
                        "stream": True})
                    body = await r.read()
                    if r.status != 200 or b"[DONE]" not in body or b'"error"' in body:
                        bad.append((r.status, body[-200:]))
                    done[0] += 1

            first = None
            async with anyio.create_task_group() as tg:
                for _ in range(args.streams):
                    tg.start_soon(stream)
                for i in range(args.cycles):
                    start = time.perf_counter()
                    r = await client.post("/models/load", json={"model": args.model})
                    assert r.status == 200, await r.text()
                    for _ in range(2):
                        r = await client.post("/v1/completions", json={
                            "model": args.model, "prompt": "hi", "max_tokens": 4})
                        assert r.status == 200, await r.text()
                    loaded = time.perf_counter()
                    r = await client.post("/models/unload", json={"model": args.model})
                    assert r.status == 200, await r.text()
                    gc.collect()
                    now = rss_mib()
                    first = first or now
                    print(f"cycle {i}: load + 2 requests {loaded - start:.2f} s, unload "
                          f"{time.perf_counter() - loaded:.2f} s, RSS {now:.0f} MiB "
                          f"({100 * (now - first) / first:+.1f}%)", flush=True)
                stop.set()
            engine = registry.entries[args.streaming].engine
            stats = engine.stats() if engine is not None else None
            print(f"{done[0]} requests on {args.streaming}, {len(bad)} failed; free blocks "
                  f"{stats and stats.num_free_blocks}/{stats and stats.num_total_blocks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir")
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streaming", default="tiny")
    parser.add_argument("--streams", type=int, default=4)
    anyio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
