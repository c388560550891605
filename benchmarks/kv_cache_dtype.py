"""``--kv-cache-dtype``: what a float8 KV cache gives and costs, each dtype against ``auto`` in
one run (the embedded SmolLM2-135M unless --model).

For each of auto, fp8 (e4m3) and fp8_e5m2:

- **blocks**: the KV blocks a ``--kv-cache-memory`` of --memory holds;
- **quality**: the mean negative log-likelihood per token of a text (this repository's
  docs, --text-tokens tokens; prompt logprobs, so every position attends the rounded cache)
  and its difference from auto's; and how many of --greedy-tokens greedy tokens after the
  text's first 200 tokens equal auto's before the first difference;
- **speed**: ``benchmarks/decode_step.py``'s best decode step at --batch requests of
  --prompt-len tokens, the dtypes alternated --rounds times (separate processes).

Usage:

    python benchmarks/kv_cache_dtype.py [--batch 32] [--prompt-len 1000] [--rounds 2]
        [--text-tokens 1500] [--memory 1GiB] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

DTYPES = ("auto", "fp8", "fp8_e5m2")
ROOT = Path(__file__).resolve().parents[1]


def quality(args: argparse.Namespace, dtype: str) -> tuple[int, float, list[int]]:
    """(blocks, mean NLL of the text, greedy tokens after its first 200) with ``dtype``."""
    from asyncengine import LLM, SamplingParams

    kw = {"kv_cache_dtype": dtype, "kv_cache_memory": args.memory, "max_model_len": 4096}
    if args.model:
        kw["model"] = args.model
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    llm = LLM(**kw)
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = llm.tokenizer.encode(text)[:args.text_tokens]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    nll = [-next(iter(x.values())).logprob if t is None else -x[t].logprob
           for t, x in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    greedy = llm.generate([ids[:200]], SamplingParams(temperature=0,
                                                      max_tokens=args.greedy_tokens))[0]
    blocks = llm.engine.num_total_blocks
    llm.engine.shutdown()
    return blocks, math.fsum(nll) / len(nll), greedy.outputs[0].token_ids


def step_ms(args: argparse.Namespace, dtype: str) -> float:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_step.py"), "--batch",
           str(args.batch), "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
           "--kv-cache-dtype", dtype]
    if args.model:
        cmd += ["--model", args.model]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"decode step best ([\d.]+) ms", out).group(1))


def main(args: argparse.Namespace) -> int:
    rows = {d: quality(args, d) for d in DTYPES}
    steps: dict[str, list[float]] = {d: [] for d in DTYPES}
    for _ in range(args.rounds):  # alternated: the machine's phases hit every dtype alike
        for d in DTYPES:
            steps[d].append(step_ms(args, d))
    base_blocks, base_nll, base_greedy = rows["auto"]
    base_step = min(steps["auto"])
    print(f"text {args.text_tokens} tokens; decode steps of {args.batch} requests x "
          f"{args.prompt_len} tokens, best of {args.rounds} runs of {args.steps} steps")
    print(f"{'dtype':10s} {'blocks':>7s} {'x auto':>7s} {'NLL':>8s} {'+ vs auto':>10s} "
          f"{'same greedy':>12s} {'step ms':>8s} {'x auto':>7s}")
    for d in DTYPES:
        blocks, nll, greedy = rows[d]
        same = next((i for i, (a, b) in enumerate(zip(greedy, base_greedy, strict=False))
                     if a != b), min(len(greedy), len(base_greedy)))
        best = min(steps[d])
        print(f"{d:10s} {blocks:7d} {blocks / base_blocks:7.2f} {nll:8.4f} "
              f"{nll - base_nll:+10.4f} {same:5d} of {args.greedy_tokens:<4d} {best:8.1f} "
              f"{base_step / best:7.2f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--text-tokens", type=int, default=1500)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--memory", default="1GiB", help="--kv-cache-memory")
    parser.add_argument("--num-threads", type=int, default=0, help="default: all cores")
    raise SystemExit(main(parser.parse_args()))
