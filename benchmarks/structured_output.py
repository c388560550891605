"""The cost of structured outputs when serving: output tokens/s with 100% JSON-schema requests
against 0%, in the same run, on the same server (the embedded SmolLM2-135M unless --model).

Both phases send the same prompts with the same max_tokens through /v1/completions (streamed,
over aiohttp) at a fixed concurrency. The schemas ask for long arrays, so constrained requests
run to max_tokens like the free ones (ignore_eos): the two phases produce the same number of
tokens and the ratio measures the per-token cost of the grammar (bitmask fill on the loop,
masking in the worker). Phases alternate for --rounds rounds; the figures are totals.

    python benchmarks/structured_output.py [--concurrency 32] [--num-requests 64]
        [--max-tokens 96] [--rounds 1] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp

PROMPTS = ["List some people you know, as JSON.", "Describe a few cities as JSON.",
           "Give me product records in JSON.", "Write a JSON log of recent events.",
           "Invent some books and their authors, in JSON.", "Make a JSON list of pets."]


def _item(**props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


_S = {"type": "string", "maxLength": 20}
SCHEMAS = [  # minItems well past max_tokens: every constrained request runs to the limit
    {"type": "array", "minItems": 200, "items": _item(
        name=_S, age={"type": "integer", "minimum": 0, "maximum": 120})},
    {"type": "array", "minItems": 200, "items": _item(
        city=_S, country=_S, population={"type": "integer", "minimum": 0})},
    {"type": "array", "minItems": 200, "items": _item(
        sku=_S, price={"type": "number", "minimum": 0}, in_stock={"type": "boolean"},
        color={"enum": ["red", "green", "blue"]})},
    {"type": "array", "minItems": 200, "items": _item(
        title=_S, author=_item(first=_S, last=_S), year={"type": "integer"})},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(session: aiohttp.ClientSession, base: str, proc: subprocess.Popen,
                     timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("the server did not become ready")


async def one_request(session: aiohttp.ClientSession, base: str, i: int, constrained: bool,
                      max_tokens: int) -> int:
    """Stream one completion; return its output token count."""
    body: dict = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                  "temperature": 0.0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": f"schema{i % len(SCHEMAS)}", "schema": SCHEMAS[i % len(SCHEMAS)]}}
    tokens = 0
    async with session.post(f"{base}/v1/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def phase(session: aiohttp.ClientSession, base: str, constrained: bool, args) -> tuple:
    """(output tokens, seconds) for num_requests requests at the given concurrency."""
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> int:
        async with sem:
            return await one_request(session, base, i, constrained, args.max_tokens)

    start = time.perf_counter()
    counts = await asyncio.gather(*(limited(i) for i in range(args.num_requests)))
    return sum(counts), time.perf_counter() - start


async def run(args, base: str, proc: subprocess.Popen) -> None:
    timeout = aiohttp.ClientTimeout(total=None)
    conn = aiohttp.TCPConnector(limit=args.concurrency + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        await wait_ready(session, base, proc)
        # Warm up both paths (and compile every schema once).
        await asyncio.gather(*(one_request(session, base, i, i >= 4, 8) for i in range(8)))
        totals = {False: [0, 0.0], True: [0, 0.0]}
        for r in range(args.rounds):
            for constrained in (False, True):
                tokens, secs = await phase(session, base, constrained, args)
                totals[constrained][0] += tokens
                totals[constrained][1] += secs
                label = "100% JSON schema" if constrained else "0% JSON schema  "
                print(f"round {r + 1}  {label}: {tokens} tokens in {secs:.1f} s = "
                      f"{tokens / secs:.1f} tok/s", flush=True)
    free = totals[False][0] / totals[False][1]
    json_ = totals[True][0] / totals[True][1]
    print(f"\noutput throughput at concurrency {args.concurrency}, {args.num_requests} "
          f"requests x {args.max_tokens} tokens per phase:")
    print(f"  0% JSON schema:   {free:8.1f} tok/s")
    print(f"  100% JSON schema: {json_:8.1f} tok/s")
    print(f"  ratio:            {json_ / free:8.3f}  (target >= 0.8)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("serve_args", nargs="*", help="extra `asyncengine serve` arguments")
    args = parser.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "asyncengine", "serve", "--port", str(port),
           "--max-num-seqs", str(max(args.concurrency, 1)), *args.serve_args]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        asyncio.run(run(args, f"http://127.0.0.1:{port}", proc))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
