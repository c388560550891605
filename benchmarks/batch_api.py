"""Interactive TTFT with and without a batch job running in the same server.

Starts `asyncengine serve` (the embedded SmolLM2-135M unless --model is given) with a
--batch-dir, then, for each round: sends --requests streamed chat requests one after another
and times each one's first event (TTFT) alone; uploads a batch of --batch-lines chat requests
through /v1/files and /v1/batches, waits until its lines run, sends the same number of
interactive requests again, and cancels the batch. Prints both TTFTs (median, mean, p90),
their ratio, and the batch's lines per second meanwhile. Usage:

    python benchmarks/batch_api.py [--model DIR] [--rounds 2] [--requests 8]
        [--batch-lines 200] [--max-tokens 16] [--batch-max-tokens 64] [-- EXTRA SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overload import free_port, percentile, wait_ready  # noqa: E402

TOPICS = ["the sea", "a city at night", "mountains", "a library", "trains", "the moon",
          "a garden", "winter", "a market", "rivers", "old maps", "bridges"]


def chat_body(i: int, max_tokens: int, stream: bool) -> dict:
    topic = TOPICS[i % len(TOPICS)]
    return {"messages": [{"role": "user", "content": f"Request {i}: write a few lines about "
                          f"{topic}, and say why it matters to you."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def ttft(session: aiohttp.ClientSession, base: str, i: int, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    async with session.post(base + "/v1/chat/completions",
                            json=chat_body(i, max_tokens, True)) as r:
        r.raise_for_status()
        async for line in r.content:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - start
    assert first is not None
    return first


async def interactive(session: aiohttp.ClientSession, base: str, first: int, n: int,
                      max_tokens: int) -> list[float]:
    out = []
    for i in range(first, first + n):
        out.append(await ttft(session, base, i, max_tokens))
        await asyncio.sleep(0.1)
    return out


async def start_batch(session: aiohttp.ClientSession, base: str, lines: int, first: int,
                      max_tokens: int) -> str:
    data = "\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                 "url": "/v1/chat/completions",
                                 "body": chat_body(first + i, max_tokens, False)})
                     for i in range(lines))
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data.encode(), filename="batch.jsonl")
    async with session.post(base + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}
    async with session.post(base + "/v1/batches", json=body) as r:
        return (await r.json())["id"]


async def batch_done(session: aiohttp.ClientSession, base: str, batch_id: str) -> int:
    async with session.get(f"{base}/v1/batches/{batch_id}") as r:
        counts = (await r.json())["request_counts"]
    return counts["completed"] + counts["failed"]


async def running(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(base + "/health") as r:
        return (await r.json())["num_requests_running"]


async def measure(base: str, args: argparse.Namespace) -> dict[str, list[float]]:
    result: dict[str, list[float]] = {"alone": [], "batch": [], "lines_per_s": []}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await interactive(session, base, 10_000, 2, args.max_tokens)  # warm-up
        for r in range(args.rounds):
            result["alone"] += await interactive(session, base, 1000 * r, args.requests,
                                                 args.max_tokens)
            batch_id = await start_batch(session, base, args.batch_lines, 100_000 * (r + 1),
                                         args.batch_max_tokens)
            while await running(session, base) == 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # lines in every phase: prefills and decodes
            done0, t0 = await batch_done(session, base, batch_id), time.perf_counter()
            result["batch"] += await interactive(session, base, 1000 * r + 500, args.requests,
                                                 args.max_tokens)
            done1, t1 = await batch_done(session, base, batch_id), time.perf_counter()
            result["lines_per_s"].append((done1 - done0) / (t1 - t0))
            if done1 >= args.batch_lines:
                print(f"round {r}: the batch ended before the interactive requests did; "
                      "give it more --batch-lines", file=sys.stderr)
            async with session.post(f"{base}/v1/batches/{batch_id}/cancel") as resp:
                resp.raise_for_status()
            while await running(session, base):
                await asyncio.sleep(0.05)
    return result


def summary(values: list[float]) -> str:
    return (f"median {statistics.median(values) * 1e3:.0f} ms, mean "
            f"{statistics.fmean(values) * 1e3:.0f} ms, p90 {percentile(values, 0.9) * 1e3:.0f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8,
                        help="interactive requests per phase, one after another")
    parser.add_argument("--max-tokens", type=int, default=16, help="of each interactive one")
    parser.add_argument("--batch-lines", type=int, default=200)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("serve_flags", nargs="*", help="extra `asyncengine serve` flags")
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="batch-api-bench-") as batch_dir:
        cmd = [sys.executable, "-m", "asyncengine", "serve",
               *([args.model] if args.model else []), "--port", str(port),
               "--disable-access-log", "--log-level", "warning", "--batch-dir", batch_dir,
               *args.serve_flags]
        proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        try:
            asyncio.run(wait_ready(base, proc))
            out = asyncio.run(measure(base, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    alone, batch = out["alone"], out["batch"]
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct'}; serve flags: "
          f"{args.serve_flags or 'default'}; {args.rounds} rounds of {args.requests} "
          f"interactive chat requests (max_tokens {args.max_tokens}); batches of "
          f"{args.batch_lines} lines (max_tokens {args.batch_max_tokens})")
    print(f"interactive TTFT alone:           {summary(alone)}")
    print(f"interactive TTFT during a batch:  {summary(batch)}")
    median = statistics.median(batch) / statistics.median(alone)
    mean = statistics.fmean(batch) / statistics.fmean(alone)
    print(f"ratio (during / alone): median {median:.2f}x, mean {mean:.2f}x")
    print("batch lines per second meanwhile: "
          + ", ".join(f"{v:.2f}" for v in out["lines_per_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
