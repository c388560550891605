"""Multi-LoRA throughput: 4 adapters mixed in one batch against the base model alone, in one
process (a shared machine drifts: the two sides alternate, best of --rounds each).

Random PEFT-format adapters (rank --rank on --targets of every layer, non-zero B) are written
to a temporary directory for the model (the embedded SmolLM2-135M GGUF, packed int4 on the
CPU, unless --model). Each round runs --requests greedy requests at concurrency
--concurrency (distinct prompts of ~40 tokens, --max-tokens tokens each, EOS ignored) through
``AsyncEngine.generate``: on the base engine, then on an engine with ``--enable-lora
--max-loras 4`` whose requests take the 4 adapters in turn. Prints output tokens/s of each
and the ratio (the target is >= 0.8). Then --step-rounds rounds of decode steps at batch
--concurrency on one LoRA engine alternate between a batch of base rows and one of the 4
adapters mixed (the same prompts), timing each step (best and median of each side): the
cost of the adapters themselves, without the load's drift. ``--kernel`` times one batched
LoRA call against the int4 matmul of the same projection instead (activations in --dtype). Usage:

    python benchmarks/lora.py [--concurrency 32] [--requests 64] [--max-tokens 64]
                              [--rank 16] [--targets q_proj,k_proj,v_proj,o_proj]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def write_adapter(directory: Path, model, rank: int, targets: list[str], seed: int) -> str:
    import torch
    from safetensors.torch import save_file

    from asyncengine.executor.lora.peft import dims

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        shapes = {"q_proj": (attn.q_size, "self_attn", attn.qkv_proj),
                  "k_proj": (attn.kv_size, "self_attn", attn.qkv_proj),
                  "v_proj": (attn.kv_size, "self_attn", attn.qkv_proj),
                  "o_proj": (None, "self_attn", attn.o_proj),
                  "gate_proj": (mlp.intermediate_size, "mlp", mlp.gate_up_proj),
                  "up_proj": (mlp.intermediate_size, "mlp", mlp.gate_up_proj),
                  "down_proj": (None, "mlp", mlp.down_proj)}
        for t in targets:
            out, parent, module = shapes[t]
            in_f, out_f = dims(module)
            prefix = f"base_model.model.model.layers.{i}.{parent}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out or out_f, rank,
                                                             generator=gen) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none"}))
    return str(directory)


def run(engine, prompts: list[list[int]], names: list[str | None], concurrency: int,
        max_tokens: int) -> float:
    import anyio

    from asyncengine.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    produced = 0

    async def worker(queue: list[int]) -> None:
        nonlocal produced
        while queue:
            i = queue.pop()
            async for out in engine.generate(prompts[i], params, lora_name=names[i]):
                final = out
            produced += len(final.outputs[0].token_ids)

    async def main() -> float:
        async with engine:
            queue = list(range(len(prompts)))[::-1]
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(concurrency):
                    tg.start_soon(worker, queue)
            return produced / (time.perf_counter() - start)

    return anyio.run(main)


def kernel_only(args: argparse.Namespace) -> int:
    """``--kernel``: one batched LoRA call against the packed int4 matmul of the same
    projection, SmolLM2-135M's qkv_proj (576 -> 960), --concurrency rows over 4 adapters of
    rank --rank on q, k and v (3 x rank rows of the slot table)."""
    import torch

    from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
    from asyncengine.executor.weights.int4 import Int4Linear

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    S, R, K, N, T = 5, 3 * args.rank, 576, 960, args.concurrency
    A, B = torch.randn(S, R, K) * 0.01, torch.randn(S, R, N) * 0.01
    A[0] = B[0] = 0
    span = torch.zeros(S, R, 2, dtype=torch.int64)
    for j, (lo, hi) in enumerate(((0, 576), (576, 768), (768, 960))):  # q, k, v columns
        span[:, j * args.rank:(j + 1) * args.rank] = torch.tensor([lo, hi])
    table = SlotTable(A, B, torch.tensor([0] + [R] * 4), span)
    dtype = getattr(torch, args.dtype)
    x, y = torch.randn(T, K, dtype=dtype), torch.randn(T, N, dtype=dtype)
    step = LoRAStep(torch.arange(T) % 4 + 1, S)
    base = Int4Linear(torch.randn(N, K) * 0.05)

    def best_us(f, n: int = 50) -> float:
        f()
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(n):
                f()
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e6

    lo, b = best_us(lambda: add_lora(x, y, table, step)), best_us(lambda: base(x))
    print(f"qkv_proj at {T} rows, {args.dtype}: batched LoRA (4 adapters, rank {args.rank}) "
          f"{lo:.0f} us, "
          f"int4 matmul {b:.0f} us: the adapters add {lo / b:.0%} to this projection")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.kernel:
        return kernel_only(args)
    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine

    common = {"model": args.model, "max_num_seqs": args.concurrency,
              "max_model_len": 512}
    if args.num_threads:
        common["num_threads"] = args.num_threads
    base = AsyncEngine(EngineConfig.from_dict(common))
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", base.runner.model, args.rank, targets,
                               seed=i) for i in range(4)]
        lora = AsyncEngine(EngineConfig.from_dict({
            **common, "enable_lora": True, "max_loras": 4, "max_lora_rank": args.rank,
            "lora_modules": [f"a{i}={p}" for i, p in enumerate(paths)]}))
    words = "the quick brown fox jumps over the lazy dog while a cat sleeps".split()
    # every prompt its own (no prefix-cache hits between requests on either side)
    prompts = [base.tokenizer.encode(f"{i}: " + " ".join(words[(i + j) % len(words)]
                                                         for j in range(36)))
               for i in range(args.requests)]
    names = [f"a{i % 4}" for i in range(args.requests)]
    best = {"base": 0.0, "lora": 0.0}
    for r in range(args.rounds):
        b = run(base, prompts, [None] * args.requests, args.concurrency, args.max_tokens)
        m = run(lora, prompts, names, args.concurrency, args.max_tokens)
        best["base"], best["lora"] = max(best["base"], b), max(best["lora"], m)
        print(f"round {r}: base {b:.1f} tok/s, 4 adapters mixed {m:.1f} tok/s "
              f"({m / b:.2f}x)", flush=True)
    print(f"best: base {best['base']:.1f} tok/s, 4 adapters mixed {best['lora']:.1f} tok/s, "
          f"ratio {best['lora'] / best['base']:.2f} (target >= 0.8)")
    if args.step_rounds:
        step_times(lora, prompts, names, args)
    return 0


def step_times(engine, prompts: list[list[int]], names: list[str], args) -> None:
    """Decode steps of base rows and of adapter rows, interleaved on one engine."""
    import statistics

    from asyncengine.core.request import Request
    from asyncengine.core.sampling_params import SamplingParams

    runner = engine.runner
    params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
    sides = {}
    for side in ("base", "lora"):
        sched = engine.parts.make_scheduler()
        for i in range(args.concurrency):
            r = Request(f"{side}{i}", prompts[i], params, max_model_len=engine.max_model_len)
            r.lora = engine.lora_request(names[i]) if side == "lora" else None
            sched.add_request(r)
        sides[side] = sched

    def step(sched) -> float:
        t = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(runner.prepare(out)).finish())
        return time.perf_counter() - t

    for sched in sides.values():  # prefill, then a warm-up decode
        for _ in range(3):
            step(sched)
    times: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.step_rounds):
        for side, sched in sides.items():
            step(sched)  # not timed: the other side's rows leave the persistent batch
            for _ in range(4):
                times[side].append(step(sched))
    b, m = (min(times[s]) * 1e3 for s in ("base", "lora"))
    mb, mm = (statistics.median(times[s]) * 1e3 for s in ("base", "lora"))
    print(f"decode step at batch {args.concurrency}: base rows best {b:.1f} ms (median "
          f"{mb:.1f}), 4 adapters mixed best {m:.1f} ms (median {mm:.1f}); base / adapters "
          f"{b / m:.2f} (best), {mb / mm:.2f} (median)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--step-rounds", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="--kernel: the activations' dtype")
    p.add_argument("--kernel", action="store_true",
                   help="time one batched LoRA call against the int4 matmul only")
    raise SystemExit(main(p.parse_args()))
