"""Decode-step time, measured directly: scheduler -> runner.prepare -> runner.execute ->
update, with no event loop or server around it (the embedded SmolLM2-135M unless --model).

BATCH requests with prompts of --prompt-len tokens (100) are prefilled, then decode steps are
timed; the figure is the best and the median of --steps steps (a shared machine is noisy: take
the best of several runs). Usage:

    python benchmarks/decode_step.py [--batch 1] [--steps 30] [--quantization int8]
        [--dtype bfloat16] [--load-format dummy] [--num-threads N] [--prompt-len 100]
        [--compile [--compile-max-tokens N]] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(args: argparse.Namespace) -> int:
    import torch

    from asyncengine.config import EngineConfig
    from asyncengine.core.request import Request
    from asyncengine.core.sampling_params import SamplingParams
    from asyncengine.executor.build import build

    options = {"model": args.model, "dtype": args.dtype, "load_format": args.load_format,
               "max_num_seqs": max(args.batch, 1)}
    if args.quantization != "none":
        options["quantization"] = args.quantization
    if args.num_threads:
        options["num_threads"] = args.num_threads
    if args.compile:
        options.update(compile=True, compile_max_tokens=args.compile_max_tokens
                       or max(args.batch, 1))
    parts = build(EngineConfig.from_dict(options))
    scheduler = parts.make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True)
    for i in range(args.batch):
        scheduler.add_request(Request(f"r{i}", [100 + i] * args.prompt_len, params,
                                      max_model_len=parts.max_model_len))

    def step() -> int:
        out = scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            raise SystemExit("nothing could be scheduled: is the KV cache too small?")
        inputs = parts.runner.prepare(out)
        result = parts.runner.execute(inputs)
        scheduler.update_from_output(out, result)
        return len(result.sampled_token_ids)

    # The prefills (several steps at large batches: --max-num-batched-tokens caps a step),
    # until every request samples, then warm-up decodes.
    while step() < args.batch:
        pass
    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    from asyncengine.executor.models.quantization import weight_footprint

    sizes = weight_footprint(parts.runner.model)
    print("weights:", ", ".join(f"{k} {mb:.1f} MB" for k, mb in sorted(sizes.items())))
    print(f"model={parts.model_name} dtype={parts.dtype} quantization={args.quantization} "
          f"batch={args.batch} threads={torch.get_num_threads()} compile={args.compile}: "
          f"decode step best "
          f"{min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--load-format", default="auto", help="auto, or dummy (random weights)")
    parser.add_argument("--num-threads", type=int, default=0, help="default: all cores")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--compile", action="store_true", help="the compiled CPU path")
    parser.add_argument("--compile-max-tokens", type=int, default=0,
                        help="with --compile: the largest bucket (default: --batch)")
    parser.add_argument("--profile", action="store_true", help="add a profile of 5 steps")
    raise SystemExit(main(parser.parse_args()))
