"""``asyncengine bench models --cycles N``: N loads and unloads of ``--model`` while
``--light`` serves ``--concurrency`` streams, in a router server (a subprocess).

It prints the server's resident set (VmRSS) after each unload, against the first unloaded
value (the issue's bar: within 5% after 20 cycles), the requests lost (a stream that did not
end with ``[DONE]``, or any error), and how long the streams of the other model stalled: the
longest gap between two events of a stream while an unload ran, against the longest outside
them (a full garbage collection at each unload showed there as a stall of 0.2-0.5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from typing import Any

from asyncengine.entrypoints.bench.peers import _free_port
from asyncengine.entrypoints.bench.router_client import _spawn, _wait_ready, ttft


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def run_cycles(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    extra = shlex.split(args.server_args)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.start_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        port = _free_port()
        proc = _spawn(["--models-dir", args.models_dir, "--models-max", "0", *extra], port)
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(session, proc, url, args.start_timeout)
            return await _cycles(args, session, url, proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)


async def _cycles(args: argparse.Namespace, session: Any, url: str, pid: int) -> dict[str, Any]:
    names = [m["id"] for m in (await (await session.get(url + "/models")).json())["data"]]
    light = args.light or next((n for n in names if n != args.model), None)
    if args.model not in names or light is None:
        raise ValueError(f"--model and --light: two models of --models-dir ({names})")
    await ttft(session, url, light)
    unloading: list[tuple[float, float]] = []  # (start, end) of each unload
    gaps: list[tuple[float, float]] = []  # (time, seconds since the stream's last event)
    counts = {"requests": 0, "lost": 0}
    stop = asyncio.Event()

    async def stream() -> None:
        body = {"model": light, "prompt": "Write a long story.", "stream": True,
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            counts["requests"] += 1
            last, done = time.perf_counter(), False
            async with session.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    now = time.perf_counter()
                    gaps.append((now, now - last))
                    last = now
                    done = done or line.startswith(b"data: [DONE]")
                    if b'"error"' in line:
                        done = False
                        break
            counts["lost"] += r.status != 200 or not done

    streams = [asyncio.create_task(stream()) for _ in range(args.concurrency)]
    rss = []
    try:
        await asyncio.sleep(0.5)
        for _ in range(args.cycles):
            await ttft(session, url, args.model, 4)  # loaded by this request
            start = time.perf_counter()
            r = await session.post(url + "/models/unload", json={"model": args.model})
            assert r.status == 200, await r.text()
            unloading.append((start, time.perf_counter()))
            await asyncio.sleep(0.3)  # (anything the unload left to free, freed)
            rss.append(rss_mib(pid))
    finally:
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)

    def during(t: float) -> bool:
        return any(a <= t <= b + 0.05 for a, b in unloading)

    return {"rss": rss, "light": light, **counts,
            "gap_unload": max((g for t, g in gaps if during(t)), default=0.0),
            "gap_other": max((g for t, g in gaps if not during(t)), default=0.0)}


def format_cycles(f: dict[str, Any], args: argparse.Namespace) -> str:
    rss = f["rss"]
    growth = (rss[-1] / rss[0] - 1) * 100
    return "\n".join([
        f"{len(rss)} load/unload cycles of {args.model} while {f['light']} serves "
        f"{args.concurrency} streams",
        f"  RSS after each unload (MiB): {' '.join(f'{v:.0f}' for v in rss)}",
        f"  first unloaded {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB ({growth:+.1f}%), "
        f"highest {max(rss):.0f} MiB",
        f"  requests of {f['light']}: {f['requests']}, lost {f['lost']}",
        f"  longest gap between two events of a stream: {f['gap_unload'] * 1000:.0f} ms while "
        f"an unload ran, {f['gap_other'] * 1000:.0f} ms otherwise",
    ])
