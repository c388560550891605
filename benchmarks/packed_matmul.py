"""The packed CPU kernels against float32 matmuls over SmolLM2-135M's shapes, in one run.

Times the 120 decoder linears (30 layers of fused q/k/v 960x576, o 576x576, fused gate/up
3072x576, down 576x1536; random weights, 513 MB in float32, far past any cache) and the
49152x576 logits head, as float32 ``F.linear`` and as the packed int4 / int8 kernels of
``asyncengine/executor/kernels/packed.py``, at a few row counts. With ``--bfloat16``: the
int4 linears over bfloat16 rows, the row kernel (``int4_bf16.cpp``, decode steps of fewer than
``int4.TILE_REQUESTS`` requests) against the byte tiles (``int4_tile8.cpp``, larger decode
steps and prefill chunks), and the int8 head's the same two ways (``int8_bf16.cpp`` /
``int8_tile8.cpp``). Usage:

    python benchmarks/packed_matmul.py [--rows 1 4 32] [--threads 2] [--bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from asyncengine.executor.kernels import packed as pk

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _best_ms(fn, rounds: int = 10) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--threads", type=int, default=0, help="default: all cores")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--bfloat16", action="store_true",
                        help="bfloat16 rows: the row kernel against the byte tiles")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (pk.available("int4") and pk.available("int8")):
        raise SystemExit("the packed kernels do not build here")
    gen = torch.Generator().manual_seed(0)
    wf = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES]
          for _ in range(args.layers)]
    w4 = [[(pk.pack_int4(torch.randint(0, 16, (n, k), generator=gen)),
            (torch.rand(n, k // 32, 2, generator=gen) * 0.01).half()) for n, k in SHAPES]
          for _ in range(args.layers)]
    head = torch.randn(49152, 576, generator=gen) * 0.02
    head8 = (torch.randint(-127, 128, (49152, 576), generator=gen, dtype=torch.int8),
             torch.rand(49152, 576 // 32, generator=gen))
    print(f"{args.layers} layers x 4 linears + the 49152x576 head, {torch.get_num_threads()} "
          "threads, best of 10 (ms)")
    if args.bfloat16:
        if not (pk.int4_bf16_available() and pk.int4_tile8_available()
                and pk.bf16_available("int8_tile8")):
            raise SystemExit("the bfloat16 row kernel or the byte tiles do not build here")
        print(f"{'rows':>5} {'int4 rows':>10} {'int4 tiles':>11} {'ratio':>6} {'head rows':>10} "
              f"{'head tiles':>11} {'ratio':>6}")
        for m in args.rows:
            xs = {576: torch.randn(m, 576).bfloat16(), 1536: torch.randn(m, 1536).bfloat16()}
            rows = _best_ms(lambda xs=xs: [pk.int4_bf16_mm(xs[q.shape[1] * 2], q, s)
                                           for layer in w4 for q, s in layer])
            tiles = _best_ms(lambda xs=xs: [pk.int4_tile8_mm(xs[q.shape[1] * 2], q, s)
                                            for layer in w4 for q, s in layer])
            h8 = _best_ms(lambda xs=xs: pk.int8_bf16_mm(xs[576], *head8))
            h8t = _best_ms(lambda xs=xs: pk.int8_tile8_mm(xs[576], *head8))
            print(f"{m:>5} {rows:>10.2f} {tiles:>11.2f} {rows / tiles:>5.2f}x {h8:>10.2f} "
                  f"{h8t:>11.2f} {h8 / h8t:>5.2f}x")
        return
    print(f"{'rows':>5} {'dec f32':>9} {'dec int4':>9} {'ratio':>6} {'head f32':>9} "
          f"{'head int8':>10} {'ratio':>6}")
    for m in args.rows:
        xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        f32 = _best_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for layer in wf for w in layer])
        i4 = _best_ms(lambda xs=xs: [pk.int4_mm(xs[q.shape[1] * 2], q, s)
                               for layer in w4 for q, s in layer])
        hf = _best_ms(lambda xs=xs: F.linear(xs[576], head))
        h8 = _best_ms(lambda xs=xs: pk.int8_mm(xs[576], *head8))
        print(f"{m:>5} {f32:>9.1f} {i4:>9.1f} {f32 / i4:>5.2f}x {hf:>9.1f} {h8:>10.1f} "
              f"{hf / h8:>5.2f}x")


if __name__ == "__main__":
    main()
