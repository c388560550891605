"""``asyncengine bench models``: what several models in one server cost a request.

A router server (``serve --models-dir DIR --enable-sleep-mode``) runs in a subprocess; the
client measures the time to first token (a streamed completion, from the request to its first
token) of:

- ``--model`` when it is not loaded (a cold load), and the same model in a fresh process
  (from starting ``serve MODEL`` to its first token: what a server per model costs instead);
- the same model loaded (warm), after ``/sleep?level=1`` and after ``/sleep?level=2``;
- a warm switch: ``--model`` right after a request to ``--light`` (both loaded);
- ``--light`` alone, then while ``--heavy`` serves ``--concurrency`` streams.

Each figure but the cold ones is the best (and the median) of ``--repeats``. With
``--cycles N`` it measures N load/unload cycles under load instead (``models_cycles.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time
from typing import Any

from asyncengine.entrypoints.bench.peers import _free_port
from asyncengine.entrypoints.bench.router_client import _spawn, _wait_ready, ttft


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", required=True, help="the router's --models-dir")
    parser.add_argument("--model", default="default",
                        help="the model loaded cold, put to sleep and woken (default: the "
                             "embedded one)")
    parser.add_argument("--light", default=None,
                        help="the model whose TTFT is measured under load (default: another "
                             "model of the directory)")
    parser.add_argument("--heavy", default=None,
                        help="the model serving --concurrency streams (default: --model)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens of each heavy stream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-args", default="",
                        help="more flags for both servers, e.g. '--dtype float32'")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--cycles", type=int, default=0,
                        help="instead: load and unload --model N times while --light serves "
                             "--concurrency streams; the server's RSS after each unload, the "
                             "requests lost, the streams' longest stall")


async def _router_figures(args: argparse.Namespace, session: Any, url: str) -> dict[str, Any]:
    models = (await (await session.get(url + "/models")).json())["data"]
    names = [m["id"] for m in models]
    if args.model not in names:
        raise ValueError(f"--model: {args.model!r} is not in --models-dir (it has "
                         f"{', '.join(names)})")
    light = args.light or next((n for n in names if n != args.model), None)
    if light is None:
        raise ValueError("--light: the directory holds one model; give a second one")
    heavy = args.heavy or args.model
    out: dict[str, Any] = {"path": next(m.get("path") for m in models if m["id"] == args.model)}
    out["cold"] = await ttft(session, url, args.model)
    out["warm"] = await _median(args, lambda: ttft(session, url, args.model))
    for level in (1, 2):
        async def asleep(level: int = level) -> float:
            r = await session.post(url + f"/sleep?level={level}&model={args.model}")
            assert r.status == 200, await r.text()
            return await ttft(session, url, args.model)

        out[f"sleep{level}"] = await _median(args, asleep)
    await ttft(session, url, light)  # loaded

    async def switch() -> float:
        await ttft(session, url, light)
        return await ttft(session, url, args.model)

    out["switch"] = await _median(args, switch)
    out["light_alone"] = await _median(args, lambda: ttft(session, url, light))
    await ttft(session, url, heavy)
    stop = asyncio.Event()

    async def stream() -> None:
        while not stop.is_set():
            await ttft(session, url, heavy, args.max_tokens, "Write a long story.")

    streams = [asyncio.create_task(stream()) for _ in range(args.concurrency)]
    await asyncio.sleep(1.0)
    try:
        out["light_loaded"] = await _median(args, lambda: ttft(session, url, light))
        out["heavy_loaded"] = await _median(args, lambda: ttft(session, url, heavy))
    finally:
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    out.update(light=light, heavy=heavy)
    return out


async def _median(args: argparse.Namespace, fn: Any) -> tuple[float, float]:
    """The best and the median of ``--repeats`` runs (the machines are shared: the best is
    the figure to quote)."""
    runs = [await fn() for _ in range(args.repeats)]
    return min(runs), statistics.median(runs)


async def _fresh_process(args: argparse.Namespace, session: Any, path: str | None,
                         extra: list[str]) -> float:
    """From starting ``serve MODEL`` to its first token."""
    port = _free_port()
    start = time.perf_counter()
    proc = _spawn([*([path] if path else []), *extra], port)
    try:
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(session, proc, url, args.start_timeout)
        await ttft(session, url, None)
        return time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    extra = shlex.split(args.server_args)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.start_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        port = _free_port()
        started = time.perf_counter()
        proc = _spawn(["--models-dir", args.models_dir, "--enable-sleep-mode",
                       "--models-max", "0", *extra], port)
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(session, proc, url, args.start_timeout)
            figures = {"router_start": time.perf_counter() - started}
            figures.update(await _router_figures(args, session, url))
        finally:
            proc.terminate()
            proc.wait(60)
        figures["fresh"] = await _fresh_process(args, session, figures["path"], extra)
    return figures


def format_figures(f: dict[str, Any], args: argparse.Namespace) -> str:
    def ms(value: float | tuple[float, float]) -> str:
        if isinstance(value, tuple):
            return f"{value[0] * 1000:9.1f} ms (median {value[1] * 1000:.1f})"
        return f"{value * 1000:9.1f} ms"

    rows = [
        (f"cold load of {args.model}, to its first token", ms(f["cold"])),
        (f"a fresh `serve {args.model}` process, start to first token", ms(f["fresh"])),
        ("loaded (warm)", ms(f["warm"])),
        ("after /sleep?level=1 (KV cache freed)", ms(f["sleep1"])),
        ("after /sleep?level=2 (weights dropped)", ms(f["sleep2"])),
        (f"warm switch ({f['light']} then {args.model})", ms(f["switch"])),
        (f"{f['light']} alone", ms(f["light_alone"])),
        (f"{f['light']} while {f['heavy']} serves {args.concurrency} streams",
         ms(f["light_loaded"])),
        (f"{f['heavy']} itself at that load", ms(f["heavy_loaded"])),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"time to first token (best of {args.repeats} where repeated)"]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.cycles:
        from asyncengine.entrypoints.bench.models_cycles import format_cycles, run_cycles

        figures = asyncio.run(run_cycles(args))
        print(format_cycles(figures, args))
        print(json.dumps(figures))
        return 0
    figures = asyncio.run(run(args))
    print(format_figures(figures, args))
    print(json.dumps({k: v for k, v in figures.items() if k != "path"}))
    return 0
