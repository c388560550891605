"""Does loading one model stall another's stream? A router (in-process, aiohttp's test
server) streams 400 tokens from ``--streaming`` while ``--model`` loads; prints the load's
time and the largest gap between the stream's chunks before and during the load
(docs/benchmarks.md, "Several models in one server"). Usage:

    PYTHONPATH=. python benchmarks/model_load_gaps.py MODELS_DIR [--model default]
        [--streaming tiny]
"""

from __future__ import annotations

import argparse
import time

import anyio


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
                                   "max_model_len": 512})
    registry = ModelRegistry(build_catalog(args.models_dir, {}, embedded=True),
                             engine_factory(base, make_metrics))
    async with registry:
        app = build_app(None, None, ServerSettings(models_dir=args.models_dir),
                        registry=registry)
        async with TestClient(TestServer(app)) as client:
            await client.post("/v1/completions", json={"model": args.streaming,
                                                       "prompt": "hi", "max_tokens": 2})
            gaps: list[tuple[float, float]] = []

            async def stream() -> None:
                r = await client.post("/v1/completions", json={
                    "model": args.streaming, "prompt": "hi", "max_tokens": 400,
                    "stream": True, "ignore_eos": True})
                last = time.perf_counter()
                async for _ in r.content:
                    now = time.perf_counter()
                    gaps.append((now - last, now))
                    last = now

            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                await anyio.sleep(1.0)
                start = time.perf_counter()
                r = await client.post("/models/load", json={"model": args.model})
                end = time.perf_counter()
            during = [g for g, t in gaps if start <= t <= end]
            before = [g for g, t in gaps if t < start]
            print(f"load of {args.model}: {r.status}, {end - start:.2f} s")
            print(f"{args.streaming}'s stream: largest gap between chunks {max(before) * 1e3:.0f}"
                  f" ms before the load ({len(before)} chunks), {max(during) * 1e3:.0f} ms "
                  f"during it ({len(during)} chunks, mean {1e3 * sum(during) / len(during):.1f}"
                  " ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir")
    parser.add_argument("--model", default="default")
    parser.add_argument("--streaming", default="tiny")
    anyio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
