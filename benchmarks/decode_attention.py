"""Decode attention alone, one layer, three ways in one process over the same cache,
interleaved: the padded gather (one SDPA call over every decode row's whole history), the
chunked read (``attention/decode_chunks.py``), and the own CPU kernel that reads the paged
cache in place (``kernels/decode_attention.cpp``, the default on the CPU). With
``--kv-cache-dtype fp8`` (or ``fp8_e5m2``) the kernel also reads the same cache rounded to
float8 (``kernels/kv_fp8.h``), interleaved with the others; its difference is taken against
the gather over the rounded cache.

Contexts are drawn uniformly from [--min-ctx, --max-ctx]; SmolLM2-135M's attention shape (9
query heads, 3 KV heads, head_dim 64) by default. Prints the best and median time per layer
call and the KV copy alive at a time (the gathered K and V). Usage:

    python benchmarks/decode_attention.py [--batch 32] [--min-ctx 100] [--max-ctx 4096]
        [--dtype float32] [--repeats 20] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time


def main(args: argparse.Namespace) -> int:
    import torch

    from asyncengine.executor.attention import decode_chunks, torch_paged
    from asyncengine.executor.attention.base import AttentionMetadata
    from asyncengine.executor.kernels import layer_ops

    dtype = getattr(torch, args.dtype)
    bs, heads, kv_heads, dim = args.block_size, args.heads, args.kv_heads, args.head_dim
    rng = random.Random(0)
    lens = [rng.randint(args.min_ctx, args.max_ctx) for _ in range(args.batch)]
    need = [math.ceil(n / bs) for n in lens]
    pool = list(range(sum(need) + 1))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in need]
    width = max(need)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens,
                                                                                strict=True)])
    cache = torch.randn(2, sum(need) + 1, bs, kv_heads, dim).to(dtype)
    q = torch.randn(args.batch, heads, dim).to(dtype)
    k = torch.randn(args.batch, kv_heads, dim).to(dtype)
    v = torch.randn(args.batch, kv_heads, dim).to(dtype)
    elem = cache.element_size()

    caches = {"": cache}
    if args.kv_cache_dtype != "auto":
        from asyncengine.executor.kv.dtype import FP8_DTYPES, to_cache

        caches[args.kv_cache_dtype] = to_cache(cache, FP8_DTYPES[args.kv_cache_dtype])

    def run(threshold: int, kernel: bool, kv: str = "") -> tuple[list[float], torch.Tensor]:
        torch_paged.DECODE_CHUNK_TOKENS = threshold
        layer_ops.ENABLED = kernel
        backend = torch_paged.TorchPagedBackend()
        times, out = [], None
        for _ in range(args.repeats):
            meta = AttentionMetadata(list(range(args.batch + 1)), lens, padded, slots, bs)
            backend.prepare(meta)
            start = time.perf_counter()
            out = backend.forward(q, k, v, caches[kv], meta, dim**-0.5)
            times.append(time.perf_counter() - start)
        return times, out

    chunk = decode_chunks.DECODE_CHUNK_TOKENS
    paths = [("gather", 1 << 30, False, ""), ("chunked", chunk, False, "")]
    if layer_ops._kernels(dtype) is not None:
        paths.append(("kernel", chunk, True, ""))
        if len(caches) > 1:
            paths.append((f"kernel {args.kv_cache_dtype}", chunk, True, args.kv_cache_dtype))
    results: dict[str, list[float]] = {name: [] for name, _, _, _ in paths}
    outs = {}
    for _ in range(3):  # interleaved: the machine's load hits all alike
        for name, threshold, kernel, kv in paths:
            times, outs[name] = run(threshold, kernel, kv)
            results[name] += times
    diff = max((outs[name].double() - outs["gather"].double()).abs().max().item()
               for name, _, _, kv in paths if not kv)
    if len(caches) > 1:  # against the gather over the widened float8 cache
        rounded = caches[args.kv_cache_dtype].to(dtype)
        caches[""] = rounded
        ref = run(1 << 30, False)[1]
        caches[""] = cache
        name = f"kernel {args.kv_cache_dtype}"
        diff = max(diff, (outs[name].double() - ref.double()).abs().max().item())
    per_chunk = max(1, chunk // bs) * bs
    copy = {"gather": args.batch * width * bs,
            "chunked": args.batch * min(width * bs, per_chunk)}
    print(f"batch={args.batch} contexts {min(lens)}..{max(lens)} (mean {sum(lens) // len(lens)}) "
          f"dtype={args.dtype} threads={torch.get_num_threads()} chunk={chunk} tokens; "
          f"max |difference| {diff:.2e}")
    read = sum(lens) * kv_heads * dim * 2  # K and V elements the step reads
    for name, _, _, kv in paths:
        times = results[name]
        mb = copy.get(name, 0) * kv_heads * dim * 2 * elem / 2**20
        size = caches[kv].element_size()
        print(f"  {name:14s} best {min(times) * 1e3:7.2f} ms  median "
              f"{statistics.median(times) * 1e3:7.2f} ms per layer; KV read "
              f"{read * size / 2**20:6.1f} MB, copy alive {mb:7.1f} MB")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-ctx", type=int, default=100)
    parser.add_argument("--max-ctx", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3",
                                                                     "fp8_e5m2"])
    raise SystemExit(main(parser.parse_args()))
