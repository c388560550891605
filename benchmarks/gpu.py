"""GPU figures of the CUDA step path (issues 10 and 25). Needs a CUDA GPU; exits with a
message without (``--dry-run`` prints the plan and the models' byte counts anywhere).

One run measures everything issue 25's part 2 asks, each against a baseline measured in the
same run on the same device:

1. ``decode``: batch-1 decode, time per output token, for the Llama-3.2-1B shape and the
   Llama-3.1-8B shape (dummy bfloat16 weights; CUDA graphs; FlashInfer), against the HBM
   bound: (weight bytes + KV bytes read per token) / device-to-device copy bandwidth (a large
   ``copy_``, bytes read plus written). Targets: >= 60% of the bound at 1B, >= 80% at 8B.
   It also times the host's work per step (``runner.prepare`` on the loop, ``enqueue``:
   FlashInfer's plan, the static-buffer copies and the graph replay's launch) to tell whether
   Python planning before each replay bounds batch-1 decode.
2. ``idle``: GPU idle between steps at 256 streams (1B shape): CUDA events (timing) recorded
   on the device's stream around every step's work; idle = the gaps between one step's end
   and the next one's start, over consecutive full-batch decode steps. Measured under both
   ways of awaiting a step's event (``ASYNCENGINE_CUDA_AWAIT=thread|poll``) on the same
   engine, and the default to choose is printed (the one with less idle). Target < 5%.
3. ``throughput``: output tokens/s at concurrency 1, 32 and 256 (1B shape), next to
   transformers' ``generate`` (same weights, bfloat16, static batch, same device) as a floor.

Usage: python benchmarks/gpu.py [--only decode,idle,throughput] [--shapes 1b,8b]
    [--layer-ops fused,pytorch] [--tokens 128] [--batch 256] [--concurrency 1,32,256]
    [--json FILE] [--profiler] [--host-profile] [--dry-run]

The tokenizer (only used to detokenize; ids past its vocabulary decode to nothing) is
``--tokenizer``, else ``$ASYNCENGINE_TEST_TOKENIZER_DIR`` (``make gpu-wheelhouse`` carries
one), else the embedded model's. It first ran on an H100 on 2026-11-27 (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=8192)
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, head_dim=64, bos_token_id=128000, eos_token_id=128001,
                rope_scaling=dict(factor=32.0, **_ROPE))
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, head_dim=128, bos_token_id=128000, eos_token_id=128001,
                rope_scaling=dict(factor=8.0, **_ROPE))
SHAPES = {"1b": ("Llama-3.2-1B", LLAMA_1B, 0.60), "8b": ("Llama-3.1-8B", LLAMA_8B, 0.80)}
PARTS = ("decode", "idle", "throughput")
PROMPT_LEN = 128
BF16 = 2


def weight_bytes(shape: dict[str, Any], dtype_bytes: int = BF16) -> int:
    """Parameter bytes of a Llama of ``shape`` (what one decode step reads at batch 1)."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], \
        shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    embed = shape["vocab_size"] * h
    head = 0 if shape["tie_word_embeddings"] else embed
    return (layers * per_layer + embed + head + h) * dtype_bytes


def kv_bytes_per_token(shape: dict[str, Any], context: float, dtype_bytes: int = BF16) -> float:
    """KV-cache bytes one decode step of one request reads at ``context`` tokens."""
    return (shape["num_hidden_layers"] * 2 * context * shape["num_key_value_heads"]
            * shape["head_dim"] * dtype_bytes)


def hbm_bound(shape: dict[str, Any], context: float, bandwidth: float) -> float:
    """Seconds per token at batch 1 if every byte read moved at ``bandwidth``."""
    return (weight_bytes(shape) + kv_bytes_per_token(shape, context)) / bandwidth


def recommend_await(idle: dict[str, float]) -> str:
    """The await mechanism with the least GPU idle (ties: the current default, thread)."""
    return min(sorted(idle, key=lambda m: m != "thread"), key=lambda m: idle[m])


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device bandwidth in bytes/s: each copy reads and writes ``nbytes``."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def tokenizer_path(args: argparse.Namespace) -> str:
    if args.tokenizer:
        return args.tokenizer
    saved = os.environ.get("ASYNCENGINE_TEST_TOKENIZER_DIR")
    if saved and os.path.isfile(os.path.join(saved, "tokenizer_config.json")):
        return saved
    from asyncengine.executor.weights.loader import embedded_model_path

    return embedded_model_path()


def model_dir(shape: dict[str, Any], name: str) -> str:
    from transformers import LlamaConfig

    directory = tempfile.mkdtemp(prefix=f"asyncengine-{name}-")
    config = LlamaConfig(**shape)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    return directory


def make_engine(args: argparse.Namespace, directory: str, max_num_seqs: int):
    """An engine on the GPU, built after the previous part's engine has been collected and
    torch's cache emptied: the engine's start-up check wants its whole share free, and an
    engine dropped by the caller a moment ago may still be held by a reference cycle (the
    first GPU run failed here: 12 of 79 GiB free for the throughput part's engine)."""
    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine

    release_gpu_memory()
    return AsyncEngine(EngineConfig.from_dict({
        "model": directory, "load_format": "dummy", "tokenizer": tokenizer_path(args),
        "dtype": "bfloat16", "device": "cuda", "max_model_len": 4096,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192,
        "enforce_eager": args.enforce_eager,
        "gpu_memory_utilization": args.gpu_memory_utilization}))


def release_gpu_memory() -> None:
    """Collect what is no longer referenced (engines in reference cycles included) and give
    torch's cached blocks back, so that ``torch.cuda.mem_get_info`` counts them as free."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


async def decode_times(engine, num_requests: int, tokens: int, prompt_len: int = PROMPT_LEN,
                       ) -> list[list[float]]:
    """Arrival times of each request's output tokens (all requests at once)."""
    import anyio

    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    times: list[list[float]] = [[] for _ in range(num_requests)]

    async def one(i: int) -> None:
        prompt = [(1000 + 7 * i + j) % 120000 for j in range(prompt_len)]
        seen = 0
        async for out in engine.generate(prompt, params):
            n = len(out.outputs[0].token_ids)
            now = time.perf_counter()
            times[i] += [now] * (n - seen)
            seen = n

    async with anyio.create_task_group() as tg:
        for i in range(num_requests):
            tg.start_soon(one, i)
    return times


class HostTimer:
    """Host seconds per step spent in ``runner.prepare`` and ``runner.execute`` (which only
    enqueues on CUDA)."""

    def __init__(self, runner) -> None:
        self.runner, self.prepare, self.execute = runner, [], []
        self._prepare, self._execute = runner.prepare, runner.execute
        runner.prepare = self._timed(self._prepare, self.prepare)
        runner.execute = self._timed(self._execute, self.execute)

    @staticmethod
    def _timed(fn, into: list[float]):
        def timed(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            into.append(time.perf_counter() - start)
            return out
        return timed

    def restore(self) -> None:
        self.runner.prepare, self.runner.execute = self._prepare, self._execute


class StepMarks:
    """CUDA events recorded on the device's stream around every step's work (``execute``):
    a step's span is the GPU's time on it, and the gap before the next step's start is the
    GPU waiting for the host."""

    def __init__(self, runner) -> None:
        import torch

        self.runner, self._execute = runner, runner.execute
        self.marks: list[tuple[Any, Any, int]] = []

        def execute(inputs):  # runs on the device's stream, in step order
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._execute(inputs)
            end.record()
            self.marks.append((start, end, inputs.num_tokens))
            return out

        runner.execute = execute

    def restore(self) -> None:
        self.runner.execute = self._execute

    def spans_and_gaps(self, num_tokens: int, skip: int = 0) -> tuple[list[float], list[float]]:
        """Over consecutive steps of ``num_tokens`` tokens (after the first ``skip`` marks):
        each step's span and the gap after it, in ms."""
        import torch

        torch.cuda.synchronize()
        marks = self.marks[skip:]
        full = {i for i, (_, _, n) in enumerate(marks) if n == num_tokens}
        pairs = [i for i in sorted(full) if i + 1 in full]
        gaps = [max(0.0, marks[i][1].elapsed_time(marks[i + 1][0])) for i in pairs]
        spans = [marks[i][0].elapsed_time(marks[i][1]) for i in pairs]
        return spans, gaps


class HostProfile:
    """``--host-profile``: cProfile over the timed steps, on the loop's thread (where
    ``prepare``, ``enqueue`` and emission run; the waiter and launcher threads are not
    profiled), printed as the functions with the most time of their own, per step."""

    def __init__(self, on: bool) -> None:
        import cProfile

        self.profile = cProfile.Profile() if on else None

    def __enter__(self) -> HostProfile:
        if self.profile is not None:
            self.profile.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profile is not None:
            self.profile.disable()

    def report(self, steps: int, top: int = 25) -> list[str]:
        """The ``top`` functions by own time: ms per step (own, cumulative), calls per step."""
        import pstats

        if self.profile is None:
            return []
        stats = pstats.Stats(self.profile).stats  # (file, line, name) -> (cc, nc, tt, ct, _)
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        total = sum(v[2] for v in stats.values())
        lines = [f"  host profile (loop thread, {steps} steps; profiled, so slower): "
                 f"{1e3 * total / steps:.3f} ms per step in all; own ms, cumulative ms and "
                 "calls per step:"]
        for (file, line, name), (_, calls, own, cum, _) in rows:
            where = f"{os.path.basename(file)}:{line}" if line else file
            lines.append(f"    {1e3 * own / steps:8.3f} {1e3 * cum / steps:8.3f} "
                         f"{calls / steps:7.1f}  {name} ({where})")
        return lines


def idle_percent(spans: list[float], gaps: list[float]) -> float:
    return 100 * sum(gaps) / max(sum(gaps) + sum(spans), 1e-9)


def host_verdict(gpu_idle_percent: float) -> str:
    """Whether the host's work per step, not the GPU, sets the pace: the GPU waits between
    steps for more than a tenth of the time."""
    return "BOUNDS" if gpu_idle_percent > 10 else "does not bound"


def batch1_decode(args: argparse.Namespace, key: str, bandwidth: float) -> dict[str, Any]:
    import anyio
    import torch

    from asyncengine.executor.kernels import cuda_layer_ops

    name, shape, target = SHAPES[key]
    engine = make_engine(args, model_dir(shape, name), max_num_seqs=1)
    timer = marks = None
    profile = HostProfile(args.host_profile)
    kernels = None
    if args.profiler:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        kernels = torch_profile(activities=[ProfilerActivity.CUDA])

    async def main():
        nonlocal timer, marks
        async with engine:
            await decode_times(engine, 1, 32)  # warm-up
            timer, marks = HostTimer(engine.runner), StepMarks(engine.runner)
            times = (await decode_times(engine, 1, args.tokens))[0]
            timer.restore()
            marks.restore()
            if args.host_profile:  # a pass of its own: the timed figures stay unprofiled
                with profile:
                    await decode_times(engine, 1, args.tokens)
            if kernels is not None:  # and one more for the kernel timeline
                with kernels:
                    await decode_times(engine, 1, args.tokens)
            return times

    times = anyio.run(main)
    skip = 16  # the prefill and the first steps
    per_token = (times[-1] - times[skip]) / (len(times) - 1 - skip)
    context = PROMPT_LEN + (skip + len(times)) / 2  # the mean context of the timed steps
    bound = hbm_bound(shape, context, bandwidth)
    host = statistics.median(timer.prepare[skip:]) + statistics.median(timer.execute[skip:])
    mode = "eager" if args.enforce_eager else "CUDA graphs"
    ops = "fused (FlashInfer)" if cuda_layer_ops.usable(torch.empty(
        0, dtype=torch.bfloat16, device="cuda")) else "PyTorch"
    print(f"[decode] {torch.cuda.get_device_name()}: {name} shape, bf16, batch 1, {mode}, "
          f"attention {engine.runner.attn_backend.name}, await {engine.device.awaiter.name}, "
          f"layer ops {ops}")
    kv = kv_bytes_per_token(shape, context)
    prep, enq = statistics.median(timer.prepare[skip:]), statistics.median(timer.execute[skip:])
    print(f"  weights {weight_bytes(shape) / 2**30:.2f} GiB + KV {kv / 2**20:.1f} MiB per "
          f"token, copy bandwidth {bandwidth / 1e9:.0f} GB/s -> HBM bound "
          f"{bound * 1e3:.3f} ms/token")
    print(f"  measured {per_token * 1e3:.3f} ms/token ({1 / per_token:.0f} tokens/s): "
          f"{100 * bound / per_token:.1f}% of the bound (target >= {100 * target:.0f}%)")
    spans, gaps = marks.spans_and_gaps(1, skip=skip)
    idle = idle_percent(spans, gaps)
    print(f"  GPU per step: busy {statistics.median(spans):.3f} ms, then idle "
          f"{statistics.median(gaps):.3f} ms until the next step's work ({idle:.1f}% idle)")
    print(f"  host per step: prepare {prep * 1e3:.3f} ms + enqueue (plan, copies, replay "
          f"launch) {enq * 1e3:.3f} ms = {host * 1e3:.3f} ms: the host's work per step "
          f"{host_verdict(idle)} batch-1 decode")
    print("\n".join(profile.report(args.tokens)))
    if kernels is not None:
        print("\n".join(kernel_table(kernels, args.tokens)))
    engine.shutdown()
    return {"shape": name, "layer_ops": ops, "ms_per_token": per_token * 1e3,
            "bound_ms": bound * 1e3,
            "fraction_of_bound": bound / per_token, "target": target,
            "host_ms_per_step": host * 1e3, "prepare_ms": prep * 1e3, "enqueue_ms": enq * 1e3,
            "gpu_busy_ms": statistics.median(spans), "gpu_gap_ms": statistics.median(gaps),
            "gpu_idle_percent": idle, "bandwidth_GBps": bandwidth / 1e9}


def idle_at_batch(engine, args: argparse.Namespace) -> tuple[float, str]:
    import anyio

    runner = engine.runner
    marks = StepMarks(runner)
    host = HostProfile(args.host_profile)
    profiler = None
    if args.profiler:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CUDA])

    async def main():
        async with engine:
            await decode_times(engine, args.batch, 8)  # warm-up
            marks.marks.clear()
            if profiler is not None:
                profiler.__enter__()
            await decode_times(engine, args.batch, args.tokens)
            if profiler is not None:
                profiler.__exit__(None, None, None)
            marks.restore()
            if args.host_profile:  # a pass of its own: the timed figures stay unprofiled
                with host:
                    await decode_times(engine, args.batch, args.tokens)

    anyio.run(main)
    spans, gaps = marks.spans_and_gaps(args.batch)  # consecutive full-batch decode steps
    idle = idle_percent(spans, gaps)
    mechanism = engine.device.awaiter.name
    print(f"[idle] {args.batch} streams, await {mechanism}: {len(spans)} consecutive full "
          f"decode steps, median step {statistics.median(spans):.2f} ms, median gap "
          f"{statistics.median(gaps):.3f} ms; GPU idle between steps {idle:.2f}% "
          "(target < 5%)")
    if profiler is not None:
        busy, window = _busy_ms(profiler)
        print(f"  kernel timeline (gaps inside steps included): GPU busy {busy:.1f} of "
              f"{window:.1f} ms, idle {100 * (1 - busy / window):.2f}%")
    print("\n".join(host.report(args.tokens)))
    waits = getattr(runner.attn_backend, "plan_waits", 0)
    print(f"  launches: {engine.device.num_loop_launches} from the loop, "
          f"{engine.device.num_thread_launches} from the launcher thread; plan waits {waits}")
    return idle, mechanism


def idle_both_mechanisms(args: argparse.Namespace) -> dict[str, Any]:
    from asyncengine.executor.runtime.cuda_await import make_event_awaiter

    name, shape, _ = SHAPES["1b"]
    engine = make_engine(args, model_dir(shape, name), max_num_seqs=args.batch)
    idle: dict[str, float] = {}
    for mechanism in args.await_mechanisms:
        engine.device.awaiter.close()
        engine.device.awaiter = make_event_awaiter(mechanism)
        idle[mechanism], _ = idle_at_batch(engine, args)
    engine.shutdown()
    best = recommend_await(idle)
    print(f"[idle] recommended ASYNCENGINE_CUDA_AWAIT default: {best} ("
          + ", ".join(f"{m} {v:.2f}%" for m, v in idle.items()) + " GPU idle)")
    return {"idle_percent": idle, "recommended_await": best}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Output tokens/s at each concurrency: asyncengine, then transformers' generate."""
    import anyio
    import torch

    name, shape, _ = SHAPES["1b"]
    directory = model_dir(shape, name)
    engine = make_engine(args, directory, max_num_seqs=max(args.concurrency))
    ours: dict[int, float] = {}

    async def run(n: int) -> float:
        async with engine:
            await decode_times(engine, n, 8)  # warm-up
            start = time.perf_counter()
            times = await decode_times(engine, n, args.tokens)
        return sum(len(t) for t in times) / (max(max(t) for t in times) - start)

    for n in args.concurrency:
        ours[n] = anyio.run(run, n)
    engine.shutdown()
    engine = None  # collected below, before transformers' model takes its memory
    release_gpu_memory()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(directory)
    with torch.device("cuda"):  # random init on the GPU: seconds, not a minute on the CPU
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    theirs: dict[int, float] = {}
    for n in args.concurrency:
        ids = torch.randint(1000, 120000, (n, PROMPT_LEN), device="cuda")
        kw = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                  pad_token_id=0)
        with torch.inference_mode():
            hf.generate(ids[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf.generate(ids, **kw)
            torch.cuda.synchronize()
        theirs[n] = n * args.tokens / (time.perf_counter() - start)
    del hf
    torch.cuda.empty_cache()
    print(f"[throughput] {name} shape, bf16, prompt {PROMPT_LEN}, {args.tokens} output tokens "
          "each: output tokens/s")
    for n in args.concurrency:
        print(f"  concurrency {n:>4}: asyncengine {ours[n]:>9.0f}   transformers generate "
              f"{theirs[n]:>9.0f}   ({ours[n] / theirs[n]:.2f}x)")
    return {"asyncengine": ours, "transformers": theirs}


def _busy_ms(profiler) -> tuple[float, float]:
    """The union of the device-side kernel and copy intervals, and the span from the first
    to the last, in ms."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                       if getattr(e, "device_type", None) is not None
                       and str(e.device_type).endswith("CUDA"))
    busy, end = 0.0, None
    for s, e in intervals:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    if not intervals:
        return 0.0, 1.0
    return busy / 1e3, (max(e for _, e in intervals) - intervals[0][0]) / 1e3


def kernel_table(profiler, steps: int, top: int = 12) -> list[str]:
    """Per decode step: how many kernels the GPU ran and for how long, and the ``top`` kernels
    by device time (count and microseconds per step), from torch.profiler's CUDA events
    (graph replays included)."""
    by_name: dict[str, list[float]] = {}
    for e in profiler.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            entry = by_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.end - e.time_range.start
    count = sum(c for c, _ in by_name.values())
    total = sum(t for _, t in by_name.values())
    lines = [f"  kernels per step: {count / steps:.1f}, {total / steps:.1f} us of device time; "
             "the costliest (calls and us per step):"]
    for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"    {c / steps:6.1f} {t / steps:9.1f}  {name[:110]}")
    return lines


def _choices(allowed: tuple[str, ...], flag: str):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{flag}: {', '.join(bad) or 'nothing'} not in "
                                             f"{', '.join(allowed)}")
        return items
    return parse


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency: {text!r} is not a list of "
                                         "integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("--concurrency: positive integers")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=_choices(PARTS, "--only"), default=list(PARTS),
                        help="comma-separated parts (default: all)")
    parser.add_argument("--shapes", type=_choices(tuple(SHAPES), "--shapes"),
                        default=list(SHAPES), help="decode shapes: 1b,8b")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens measured")
    parser.add_argument("--batch", type=int, default=256, help="streams for the idle figure")
    parser.add_argument("--concurrency", type=_ints, default=[1, 32, 256])
    parser.add_argument("--await-mechanisms", type=_choices(("thread", "poll"),
                                                            "--await-mechanisms"),
                        default=["thread", "poll"])
    parser.add_argument("--layer-ops", type=_choices(("fused", "pytorch"), "--layer-ops"),
                        default=["fused"], help="decode with FlashInfer's fused norm / RoPE / "
                        "SiLU, PyTorch's ops, or both (fused,pytorch: the ratio of one run)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--profiler", action="store_true",
                        help="also measure idle time from torch.profiler's kernel timeline, "
                        "and list batch-1 decode's kernels per step")
    parser.add_argument("--host-profile", action="store_true",
                        help="after each timed run, a profiled one (cProfile, the loop's "
                        "thread): its costliest functions per step")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the models' bytes; measure nothing")
    args = parser.parse_args(argv)
    if args.tokens < 32:
        parser.error("--tokens: at least 32 (the first 16 steps are not timed)")
    return args


def dry_run(args: argparse.Namespace) -> None:
    for key in args.shapes:
        name, shape, target = SHAPES[key]
        print(f"[decode] {name} shape: {weight_bytes(shape) / 1e9:.2f} GB of bf16 weights, "
              f"{kv_bytes_per_token(shape, PROMPT_LEN + args.tokens / 2) / 1e6:.2f} MB of KV "
              f"read per token; target >= {100 * target:.0f}% of the HBM bound")
    if "idle" in args.only:
        print(f"[idle] {args.batch} streams, await mechanisms: "
              f"{', '.join(args.await_mechanisms)}")
    if "throughput" in args.only:
        print(f"[throughput] concurrency {', '.join(map(str, args.concurrency))} vs "
              "transformers generate")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU, and none is available here "
              "(torch.cuda.is_available() is False). Nothing was measured.", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    bandwidth = copy_bandwidth()  # before an engine takes its share of the memory
    if "decode" in args.only:
        results["decode"] = []
        for key in args.shapes:
            rows = {}
            for ops in args.layer_ops:  # ASYNCENGINE_CUDA_LAYER_OPS is read at start-up
                os.environ["ASYNCENGINE_CUDA_LAYER_OPS"] = "1" if ops == "fused" else "0"
                rows[ops] = batch1_decode(args, key, bandwidth)
                results["decode"].append(rows[ops])
                save()
            os.environ.pop("ASYNCENGINE_CUDA_LAYER_OPS")
            if len(rows) == 2:
                print(f"[decode] {SHAPES[key][0]}: fused layer ops "
                      f"{rows['pytorch']['ms_per_token'] / rows['fused']['ms_per_token']:.2f}x "
                      "the speed of PyTorch's ops (same run)")
    if "idle" in args.only:
        results["idle"] = idle_both_mechanisms(args)
        save()
    if "throughput" in args.only:
        results["throughput"] = throughput(args)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
