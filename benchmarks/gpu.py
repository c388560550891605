"""GPU figures of the CUDA step path (issue 10). Needs a CUDA GPU; exits with a message without.

1. Batch-1 decode: time per output token of a Llama-3.2-1B-shaped model (hidden 2048, 16
   layers, 32 heads, 8 KV heads, intermediate 8192, vocab 128256, tied embeddings; dummy
   bfloat16 weights), served by the engine (step loop, CUDA graphs, FlashInfer), against
   the HBM bound: weight bytes / device-to-device bandwidth, measured in the same run with a
   large ``copy_``. Target >= 70% of the bound, goal >= 80%.
2. GPU idle at batch 256: the same model decoding 256 requests; CUDA events (timing) are
   recorded on the device's stream around every step's work, and the idle time per step is
   the gap between one step's end and the next one's start (the device waiting for the
   host). With ``--profiler``, torch.profiler's kernel timeline also gives the idle inside
   steps. Target < 10%, goal < 5%.

Usage: python benchmarks/gpu.py [--tokens 256] [--batch 256] [--enforce-eager]
    [--await-mechanism thread|poll] [--profiler]

Written without a GPU: it has never run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, head_dim=64, bos_token_id=128000, eos_token_id=128001,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192))


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


def make_engine(args: argparse.Namespace, max_num_seqs: int):
    from transformers import LlamaConfig

    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.executor.models.loader import embedded_model_path

    directory = tempfile.mkdtemp(prefix="asyncengine-llama-1b-")
    config = LlamaConfig(**LLAMA_1B)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    return AsyncEngine(EngineConfig.from_dict({
        "model": directory, "load_format": "dummy", "tokenizer": embedded_model_path(),
        "dtype": "bfloat16", "device": "cuda", "max_model_len": 4096,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192,
        "enforce_eager": args.enforce_eager,
        "gpu_memory_utilization": args.gpu_memory_utilization}))


async def decode_times(engine, num_requests: int, tokens: int, prompt_len: int = 128,
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


def batch1_decode(engine, args: argparse.Namespace, bandwidth: float) -> None:
    import anyio
    import torch

    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())

    async def main():
        async with engine:
            await decode_times(engine, 1, 32)  # warm-up
            return (await decode_times(engine, 1, args.tokens))[0]

    times = anyio.run(main)
    skip = 16  # the prefill and the first steps
    per_token = (times[-1] - times[skip]) / (len(times) - 1 - skip)
    bound = weights / bandwidth
    mode = "eager" if args.enforce_eager else "CUDA graphs"
    print(f"[decode] {torch.cuda.get_device_name()}: Llama-3.2-1B shape, bf16, batch 1, "
          f"{mode}, attention {engine.runner.attn_backend.name}, "
          f"await {engine.device.awaiter.name}")
    print(f"  weights {weights / 2**30:.2f} GiB, copy bandwidth {bandwidth / 1e9:.0f} GB/s -> "
          f"HBM bound {bound * 1e3:.3f} ms/token")
    print(f"  measured {per_token * 1e3:.3f} ms/token ({1 / per_token:.0f} tokens/s): "
          f"{100 * bound / per_token:.1f}% of the bound (target >= 70%, goal >= 80%)")


def idle_at_batch(engine, args: argparse.Namespace) -> None:
    import anyio
    import torch

    runner = engine.runner
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
    real_enqueue = runner.enqueue

    def timed_enqueue(inputs):  # runs on the device's stream, in step order
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_enqueue(inputs)
        end.record()
        marks.append((start, end, inputs.num_tokens))
        return out

    runner.enqueue = timed_enqueue
    profiler = None
    if args.profiler:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CUDA])

    async def main():
        async with engine:
            await decode_times(engine, args.batch, 8)  # warm-up
            marks.clear()
            if profiler is not None:
                profiler.__enter__()
            await decode_times(engine, args.batch, args.tokens)
            if profiler is not None:
                profiler.__exit__(None, None, None)

    anyio.run(main)
    runner.enqueue = real_enqueue
    torch.cuda.synchronize()
    full = {i for i, (_, _, n) in enumerate(marks) if n == args.batch}  # full-batch decodes
    pairs = [i for i in sorted(full) if i + 1 in full]  # consecutive full decode steps
    gaps = [max(0.0, marks[i][1].elapsed_time(marks[i + 1][0])) for i in pairs]
    spans = [marks[i][0].elapsed_time(marks[i][1]) for i in pairs]
    print(f"[idle] batch {args.batch}: {len(pairs)} consecutive full decode steps, median "
          f"step {statistics.median(spans):.2f} ms, median gap {statistics.median(gaps):.3f} ms")
    print(f"  GPU idle between steps: {100 * sum(gaps) / (sum(gaps) + sum(spans)):.2f}% "
          "(target < 10%, goal < 5%)")
    if profiler is not None:
        busy, window = _busy_ms(profiler)
        print(f"  kernel timeline (all steps of the run, gaps inside steps included): GPU "
              f"busy {busy:.1f} of {window:.1f} ms, idle {100 * (1 - busy / window):.2f}%")
    waits = getattr(runner.attn_backend, "plan_waits", 0)
    print(f"  launches: {engine.device.num_loop_launches} from the loop, "
          f"{engine.device.num_thread_launches} from the launcher thread; plan waits {waits}")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens measured")
    parser.add_argument("--batch", type=int, default=256, help="requests for the idle figure")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--await-mechanism", choices=("thread", "poll"), default=None,
                        help="sets ASYNCENGINE_CUDA_AWAIT")
    parser.add_argument("--profiler", action="store_true",
                        help="also measure idle time from torch.profiler's kernel timeline")
    parser.add_argument("--only", choices=("decode", "idle"), default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU, and none is available here "
              "(torch.cuda.is_available() is False). Nothing was measured.", file=sys.stderr)
        return 2
    if args.await_mechanism:
        os.environ["ASYNCENGINE_CUDA_AWAIT"] = args.await_mechanism
    bandwidth = copy_bandwidth()  # before the engine takes its share of the memory
    engine = make_engine(args, max_num_seqs=args.batch)
    if args.only in (None, "decode"):
        batch1_decode(engine, args, bandwidth)
    if args.only in (None, "idle"):
        idle_at_batch(engine, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
