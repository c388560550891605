"""``asyncengine bench serve``: a load generator for any OpenAI-compatible server.

It sends ``--num-prompts`` streaming requests of synthetic prompts (about ``--prompt-len``
tokens of random words, seeded) at ``--request-rate`` (Poisson arrivals; ``inf`` sends them
all at once) with at most ``--concurrency`` in flight, and reports what ``vllm bench serve``
reports: completed/failed requests, duration, request and token throughput, and the mean,
median and p99 of TTFT, TPOT (time per output token after the first), ITL (the gaps between
streamed chunks) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from asyncengine.config import environment
from asyncengine.entrypoints.bench import spec_metrics

# Common English words: nearly every one is a single token (with its leading space) in the
# BPE vocabularies of Llama-family tokenizers, so N words make a prompt of about N tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "or has had not but first one their its new after who they two her she been other when "
    "there all during into school time may years more most only over city some world would "
    "where later up such used many can state about national out known university united then "
    "made these team under film season year three game well also part both american high "
    "would district several north south east west new early war being between series before "
    "house music since second river people life work called government family group area "
    "century line name each following world place band album number through while public "
    "around based found four major same went began like great small game long club home "
    "however until last took year book town club law own best five day played against left "
    "member village old end led development children among church water system include "
    "small local early air light power station way general record open often field party "
    "love route club point red black white green blue story language land body board model"
).split()


def synthetic_prompts(num: int, prompt_len: int, seed: int) -> list[str]:
    """``num`` prompts of ``prompt_len`` random words each (distinct, reproducible)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(prompt_len)) for _ in range(num)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, e.g. http://127.0.0.1:8000 (default)")
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=100,
                        help="about this many prompt tokens (random words)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate exactly --max-tokens (vLLM extension)")
    parser.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    parser.add_argument("--api-key", default=environment.get("OPENAI_API_KEY") or None,
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one request may take (default: 600)")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="requests sent (and not measured) before the run (default: 1)")
    parser.add_argument("--save-result", metavar="FILE.json", default=None,
                        help="write the summary and per-request numbers as JSON")


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 100
    concurrency: int | None = None
    request_rate: float = math.inf
    max_tokens: int = 128
    prompt_len: int = 100
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    api_key: str | None = None
    request_timeout: float = 600.0
    num_warmups: int = 1

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url: expected http(s)://host:port, got {self.base_url!r}")
        self.base_url = self.base_url.rstrip("/")
        for name in ("num_prompts", "max_tokens", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency: must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate: must be positive (inf: all at once)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__})


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def send_request(session: aiohttp.ClientSession, cfg: BenchConfig, model: str,
                       prompt: str, max_tokens: int) -> RequestResult:
    """One streaming request; times every chunk that carries text."""
    chat = cfg.endpoint == "chat"
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    url = cfg.base_url + ("/v1/chat/completions" if chat else "/v1/completions")
    result = RequestResult()
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            done = False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    result.error = str(msg["error"].get("message", msg["error"]))
                    return result
                usage = msg.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                for choice in msg.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat \
                        else choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
            if not done:
                result.error = "the stream ended without [DONE]"
                return result
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:
        result.output_tokens = chunks
    result.success = True
    return result


async def _resolve_model(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    async with session.get(cfg.base_url + "/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}; pass --model")
        data = await resp.json()
    return data["data"][0]["id"]


async def run_benchmark(cfg: BenchConfig, prompts: list[str] | None = None) -> dict[str, Any]:
    """Run the load; return the summary (``format_report`` prints it). ``prompts``: the
    requests to send (default: ``num_prompts`` synthetic ones)."""
    if prompts is None:
        prompts = synthetic_prompts(cfg.num_prompts, cfg.prompt_len, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency or 0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:
        model = await _resolve_model(session, cfg)
        for _ in range(cfg.num_warmups):
            warm = await send_request(session, cfg, model, prompts[0], min(cfg.max_tokens, 16))
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        limit = asyncio.Semaphore(cfg.concurrency or cfg.num_prompts)
        spec_before = await spec_metrics.scrape(session, cfg.base_url)

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await send_request(session, cfg, model, prompt, cfg.max_tokens)

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        spec_after = await spec_metrics.scrape(session, cfg.base_url)
    summary = summarize(cfg, model, results, duration)
    summary.update(spec_metrics.summarize(spec_before, spec_after))
    return summary


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": cfg.base_url, "endpoint": cfg.endpoint, "model": model,
        "num_prompts": cfg.num_prompts,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "max_concurrency": cfg.concurrency, "prompt_len": cfg.prompt_len,
        "max_tokens": cfg.max_tokens,
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [x for r in ok for x in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "errors": [r.error for r in results],
    }
    return summary


def format_report(s: dict[str, Any]) -> str:
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Request rate (req/s):", s["request_rate"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            lines.append(f"{label:<40}{s[f'{stat}_{key}_ms']:<10.2f}")
    lines += spec_metrics.report_lines(s)
    lines.append("=" * 50)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = BenchConfig.from_args(args)
    except ValueError as e:
        print(f"asyncengine bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(run_benchmark(cfg))
    except (RuntimeError, aiohttp.ClientError, OSError) as e:
        print(f"asyncengine bench serve: error: {e}", file=sys.stderr)
        return 1
    print(format_report(summary))
    errors = sorted({e for e in summary["errors"] if e})
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"config": asdict(cfg) | {"api_key": None}, **summary}, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
