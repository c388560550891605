"""An overload storm against `asyncengine serve`: REQUESTS completions sent at once, while a
probe polls /health. Prints how many were served and refused (503 + Retry-After), their
latencies, the p99 latency of /health during the storm and the server's RSS before and after.

The server is started here (default flags, so the default --max-queued-requests) on the
embedded SmolLM2-135M unless --model is given. Usage:

    python benchmarks/overload.py [--requests 1500] [--max-tokens 16] [--model DIR]
        [-- EXTRA SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            try:
                async with session.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the server did not start")


async def storm(base: str, n: int, max_tokens: int) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    health_latency: list[float] = []
    done = asyncio.Event()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def probe() -> None:
            async with aiohttp.ClientSession() as own:  # its own connection, like a monitor
                while not done.is_set():
                    start = time.perf_counter()
                    async with own.get(base + "/health") as r:
                        await r.read()
                    health_latency.append(time.perf_counter() - start)
                    await asyncio.sleep(0.05)

        async def one(i: int) -> tuple[int, float, str | None]:
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
                    "ignore_eos": True}
            start = time.perf_counter()
            async with session.post(base + "/v1/completions", json=body) as r:
                await r.read()
                return r.status, time.perf_counter() - start, r.headers.get("Retry-After")

        probe_task = asyncio.create_task(probe())
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.perf_counter() - started
        done.set()
        await probe_task
    return {"results": results, "health": health_latency, "elapsed": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("serve_flags", nargs="*", help="extra `asyncengine serve` flags")
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "asyncengine", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--disable-access-log", "--log-level", "warning",
           *args.serve_flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        asyncio.run(wait_ready(base, proc))
        before = rss_mib(proc.pid)
        out = asyncio.run(storm(base, args.requests, args.max_tokens))
        peak_after = rss_mib(proc.pid)
        time.sleep(2)
        after = rss_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    results = out["results"]
    statuses: dict[int, int] = {}
    for status, _, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    served = [t for s, t, _ in results if s == 200]
    refused = [t for s, t, _ in results if s == 503]
    retry_after = {ra for s, _, ra in results if s == 503}
    health = out["health"]
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct'}; {args.requests} requests "
          f"at once, max_tokens {args.max_tokens}, serve flags: {args.serve_flags or 'default'}")
    print(f"statuses: {dict(sorted(statuses.items()))}  (storm took {out['elapsed']:.1f} s)")
    print(f"served: {len(served)}, latency p50 {percentile(served, 0.5):.2f} s, "
          f"p99 {percentile(served, 0.99):.2f} s")
    print(f"refused (503): {len(refused)}, latency p50 {percentile(refused, 0.5) * 1e3:.1f} ms, "
          f"p99 {percentile(refused, 0.99) * 1e3:.1f} ms, Retry-After {sorted(retry_after)}")
    print(f"/health during the storm: {len(health)} probes, p50 "
          f"{percentile(health, 0.5) * 1e3:.1f} ms, p99 {percentile(health, 0.99) * 1e3:.1f} ms, "
          f"max {max(health, default=float('nan')) * 1e3:.1f} ms")
    print(f"server RSS: before {before:.0f} MiB, right after {peak_after:.0f} MiB, "
          f"2 s later {after:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
