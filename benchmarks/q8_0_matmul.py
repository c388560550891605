"""Exact GGUF Q8_0 matmuls (int8 weights, one scale per 32 inputs) against float32, on the
decoder linears of the embedded SmolLM2-135M (30 layers of qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536: 120 linears, weights well out of cache, random values).

- float32: ``F.linear`` on dequantized float32 weights (what the engine does today);
- tiled: int8 weights dequantized TILE output rows at a time into a float32 matmul;
- bfloat16: for comparison (the bytes halve, the kernel changes).

Prints ms per pass over all 120 linears, at batch 1 and 32. Usage:

    python benchmarks/q8_0_matmul.py [--num-threads 1] [--tiles 64 256]
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.num_threads)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    q8 = [[(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32))
           for n, k in SHAPES] for _ in range(LAYERS)]
    bf16 = [[w.bfloat16() for w in ws] for ws in weights]

    def dense(x: torch.Tensor, ws: list[list[torch.Tensor]]) -> None:
        for layer in ws:
            for w in layer:
                F.linear(x[:, :w.shape[1]], w)

    def tiled(x: torch.Tensor, tile: int) -> None:
        for layer in q8:
            for q, d in layer:
                n, k = q.shape
                out = x.new_empty(x.shape[0], n)
                for s in range(0, n, tile):
                    e = min(n, s + tile)
                    w = (q[s:e].view(e - s, k // 32, 32).float() * d[s:e, :, None]).view(e - s, k)
                    torch.mm(x[:, :k], w.T, out=out[:, s:e])

    def bench(fn, *a) -> float:
        fn(*a)
        start = time.perf_counter()
        for _ in range(args.repeats):
            fn(*a)
        return (time.perf_counter() - start) / args.repeats * 1e3

    with torch.inference_mode():
        for batch in (1, 32):
            x = torch.randn(batch, 1536)
            row = [f"float32 {bench(dense, x, weights):.1f}"]
            row += [f"Q8_0 tiled {t} {bench(tiled, x, t):.1f}" for t in args.tiles]
            row.append(f"bfloat16 {bench(dense, x.bfloat16(), bf16):.1f}")
            print(f"batch {batch}, {args.num_threads} threads, ms per 120 linears: "
                  + ", ".join(row))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    raise SystemExit(main(parser.parse_args()))
