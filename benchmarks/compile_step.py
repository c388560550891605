"""Decode-step time eager against ``--compile``, interleaved in one process (a shared machine
drifts: both sides see the same load). The embedded SmolLM2-135M unless --model.

BATCH requests with 100-token prompts are prefilled, then rounds of --steps decode steps
alternate between the eager model and the compiled one (buckets up to --batch); prints the
compile (warm-up) time and the best and median step of each side. Usage:

    python benchmarks/compile_step.py [--batch 1] [--rounds 6] [--steps 8] [--num-threads N]
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
    from asyncengine.executor.paths.compiled import CompiledModel

    options = {"model": args.model, "dtype": args.dtype}
    if args.num_threads:
        options["num_threads"] = args.num_threads
    parts = build(EngineConfig.from_dict(options))
    runner = parts.runner
    models = {"eager": runner.model}
    start = time.perf_counter()
    compiled = CompiledModel(runner.model, args.batch)
    compiled.warm_up(progress=False)  # on this thread: the benchmark steps run here too
    print(f"compiled {len(compiled.buckets)} buckets in {time.perf_counter() - start:.1f} s")
    models["compiled"] = compiled
    scheduler = parts.make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=(args.rounds + 1) * (args.steps + 1) * 2,
                            ignore_eos=True)
    for i in range(args.batch):
        scheduler.add_request(Request(f"r{i}", [100 + i] * 100, params,
                                      max_model_len=parts.max_model_len))

    def step() -> None:
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(runner.prepare(out)).finish())

    for _ in range(4):  # the prefill, then warm-up decodes
        step()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            runner.model = model
            step()  # not timed: the switch
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"batch {args.batch}, {torch.get_num_threads()} threads, {name}: decode step best "
              f"{min(ts) * 1e3:.1f} ms, median {statistics.median(ts) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=0, help="default: all cores")
    raise SystemExit(main(parser.parse_args()))
