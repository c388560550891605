"""One GGUF matmul of Qwen2.5-0.5B's ffn_down shape (896 outputs x 4864 inputs) per type, this
checkout's ``kernels/kquant.cpp`` against the same kernel built from another git revision, in
one process (ratios under the same load): random blocks with unit-ish weights, best of
``--reps`` calls, one thread unless ``--threads``.

    python benchmarks/kquant_mm.py [--baseline-rev REV] [--rows 1 4] [--types Q4_K Q6_K]

``--gguf FILE``: instead, every matrix of a GGUF file in the model's order (the weights
streamed from memory as in a decode step), the time summed per type, and the tied head.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncengine.executor.kernels import build, packed  # noqa: E402
from asyncengine.executor.weights import kquants  # noqa: E402


def baseline_kernel(rev: str, directory: Path):
    """``kquant`` as of git revision ``rev`` (its ``kernels/`` files written to ``directory``)."""
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        data = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (directory / Path(name).name).write_bytes(data)
    return build.load("kquant", packed._ARGS["kquant"], None, directory)


# Where each type's float16 scales sit in its block (byte offsets).
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2),
               14: (208,), 23: (0,)}


def weights(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random blocks (the gguf package cannot quantize the k-quants) with float16 scales of
    1e-3: the kernels' speed does not depend on the values."""
    _, block, size = kquants.TYPES[qtype]
    blocks = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = np.float16(1e-3).reshape(1, 1).view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def file_matrices(path: str) -> list[tuple[str, torch.Tensor, int, int]]:
    """(name, raw, type, K) of each matrix of the GGUF file at ``path``, the layers' in the
    model's order, then the head (or the tied embedding)."""
    from asyncengine.executor.weights.gguf import read_packed
    from asyncengine.executor.weights.loader import resolve_model

    src = resolve_model(path)
    tensors = read_packed(src.gguf_path, src.hf_config)
    layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
    out = []
    for layer in layers:
        for name, t in tensors.items():
            if name.startswith(f"model.layers.{layer}.") and getattr(t, "raw", None) is not None \
                    and t.raw.dim() == 2 and t.qtype in kquants.TYPES and t.qtype != 0:
                out.append((name, t.raw, t.qtype, t.k))
    head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    out.append(("head", head.raw, head.qtype, head.k))
    return out


def time_file(path: str, rows: list[int], reps: int, base, new) -> None:
    mats = file_matrices(path)
    print(f"{path}: {len(mats) - 1} layer matrices + the head; CPU ms summed per type, best "
          f"of {reps} passes (the baseline and this tree alternated)")
    print("rows  type  count  baseline ms  this ms  speed-up")
    for m in rows:
        xs = {k: torch.randn(m, k) for k in {k for _, _, _, k in mats}}
        outs = {id(raw): torch.empty(m, raw.shape[0]) for _, raw, _, _ in mats}
        sums: dict[tuple[str, str], list[float]] = {}
        for _ in range(reps + 1):
            for label, fn in (("base", base), ("this", new)):
                per: dict[str, float] = {}
                for name, raw, qtype, k in mats:
                    key = "head" if name == "head" else kquants.type_name(qtype)
                    t0 = time.thread_time()
                    fn(xs[k], raw, outs[id(raw)], m, raw.shape[0], k, raw.shape[0], qtype)
                    per[key] = per.get(key, 0.0) + time.thread_time() - t0
                for key, v in per.items():
                    sums.setdefault((key, label), []).append(v)
        count = {}
        for name, _, qtype, _ in mats:
            key = "head" if name == "head" else kquants.type_name(qtype)
            count[key] = count.get(key, 0) + 1
        for key in count:
            tb = min(sums[(key, "base")][1:]) * 1e3
            tn = min(sums[(key, "this")][1:]) * 1e3
            print(f"{m:4d}  {key:5s} {count[key]:5d} {tb:12.2f} {tn:8.2f} {tb / tn:8.2f}x",
                  flush=True)


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-rev", default="HEAD")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"])
    parser.add_argument("--n", type=int, default=896)
    parser.add_argument("--k", type=int, default=4864)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gguf", help="time every matrix of this GGUF file instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    by_name = {name: t for t, (name, _, _) in kquants.TYPES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_kernel(args.baseline_rev, Path(tmp))
        new = packed._load("kquant")
        if args.gguf:
            time_file(args.gguf, args.rows, min(args.reps, 5), base, new)
            return 0
        print(f"{args.n}x{args.k}, {args.threads} thread(s), best of {args.reps}; "
              f"baseline = {args.baseline_rev}")
        print("type   rows  baseline ms  this ms  speed-up  G weights/s (this)")
        rng = np.random.default_rng(0)
        for name in args.types:
            qtype = by_name[name]
            raw = weights(qtype, args.n, args.k, rng)
            for m in args.rows:
                x = torch.randn(m, args.k)
                out = torch.empty(m, args.n)
                calls = [functools.partial(f, x, raw, out, m, args.n, args.k, args.n, qtype)
                         for f in (base, new)]
                t_base, t_new = best(calls[0], args.reps), best(calls[1], args.reps)
                print(f"{name:5s} {m:5d} {t_base:12.3f} {t_new:8.3f} {t_base / t_new:8.2f}x "
                      f"{args.n * args.k / t_new / 1e6:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
