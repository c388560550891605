"""Decode-step time, measured directly: scheduler -> runner.prepare -> runner.execute ->
update, with no event loop or server around it (the embedded SmolLM2-135M unless --model).

BATCH requests with prompts of --prompt-len tokens (100) are prefilled, then decode steps are
timed; the figure is the best and the median of --steps steps (a shared machine is noisy: take
the best of several runs). With --drafts K every timed step verifies K draft tokens per
request (speculative decoding's step of 1 + K rows a request; the drafts are rejected, so the
context grows by one token a step as without them), and the plain steps are timed in
alternation for the ratio. --prefills N then times N prefills of fresh --prompt-len prompts,
each alone in its step (no prefix-cache hit). Usage:

    python benchmarks/decode_step.py [--batch 1] [--steps 30] [--quantization int8]
        [--dtype bfloat16] [--load-format dummy] [--num-threads N] [--prompt-len 100]
        [--drafts K] [--prefills N] [--compile [--compile-max-tokens N]] [--profile]
        [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main(args: argparse.Namespace) -> int:
    import torch

    from asyncengine.config import EngineConfig
    from asyncengine.core.request import Request
    from asyncengine.core.sampling_params import SamplingParams
    from asyncengine.executor.build import build

    options = {"model": args.model, "dtype": args.dtype, "load_format": args.load_format,
               "max_num_seqs": max(args.batch, 1), "kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization != "none":
        options["quantization"] = args.quantization
    if args.num_threads:
        options["num_threads"] = args.num_threads
    if args.compile:
        options.update(compile=True, compile_max_tokens=args.compile_max_tokens
                       or max(args.batch, 1))
    if args.drafts:
        options["speculative_config"] = {"method": "ngram",
                                         "num_speculative_tokens": args.drafts}
    parts = build(EngineConfig.from_dict(options))
    scheduler = parts.make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + args.drafts + 16,
                            ignore_eos=True)
    requests = [Request(f"r{i}", [100 + i] * args.prompt_len, params,
                        max_model_len=parts.max_model_len) for i in range(args.batch)]
    for r in requests:
        scheduler.add_request(r)

    def step(drafts: int = 0) -> int:
        for r in requests:  # token ids no n-gram continues: rejected
            r.spec_token_ids = [7 + j for j in range(drafts)]
        out = scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            raise SystemExit("nothing could be scheduled: is the KV cache too small?")
        inputs = parts.runner.prepare(out)
        result = parts.runner.execute(inputs).finish()
        scheduler.update_from_output(out, result)
        return len(result.sampled_token_ids)

    # The prefills (several steps at large batches: --max-num-batched-tokens caps a step),
    # until every request samples, then warm-up decodes.
    while step() < args.batch:
        pass
    for _ in range(3):
        step()
    times, verify = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        if args.drafts:
            start = time.perf_counter()
            step(args.drafts)
            verify.append(time.perf_counter() - start)
    from asyncengine.executor.weights.quantization import weight_footprint

    sizes = weight_footprint(parts.runner.model)
    print("weights:", ", ".join(f"{k} {mb:.1f} MB" for k, mb in sorted(sizes.items())))
    print(f"model={parts.model_name} dtype={parts.dtype} quantization={args.quantization} "
          f"batch={args.batch} threads={torch.get_num_threads()} compile={args.compile}: "
          f"decode step best "
          f"{min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms")
    if verify:
        ratio = statistics.median(verify) / statistics.median(times)
        print(f"verification step (1 + {args.drafts} rows a request) best "
              f"{min(verify) * 1e3:.1f} ms, median {statistics.median(verify) * 1e3:.1f} ms: "
              f"{ratio:.2f} plain steps, {(ratio - 1) / args.drafts:.3f} a draft row")
    if args.prefills:
        from asyncengine.core.request import RequestStatus

        scheduler.finish_requests([r.request_id for r in requests],
                                  RequestStatus.FINISHED_ABORTED)
        requests.clear()
        rng = random.Random(0)
        prefill = []
        for i in range(args.prefills):
            ids = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
            scheduler.add_request(Request(f"p{i}", ids, params,
                                          max_model_len=parts.max_model_len))
            start = time.perf_counter()
            step()
            prefill.append(time.perf_counter() - start)
            scheduler.finish_requests(f"p{i}", RequestStatus.FINISHED_ABORTED)
        print(f"prefill of {args.prompt_len} tokens best {min(prefill) * 1e3:.1f} ms, "
              f"median {statistics.median(prefill) * 1e3:.1f} ms ({args.prefills} prompts)")
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
    parser.add_argument("--drafts", type=int, default=0,
                        help="also time verification steps of 1 + DRAFTS rows a request")
    parser.add_argument("--prefills", type=int, default=0,
                        help="then time this many prefills of fresh prompts, one a step")
    parser.add_argument("--compile", action="store_true", help="the compiled CPU path")
    parser.add_argument("--compile-max-tokens", type=int, default=0,
                        help="with --compile: the largest bucket (default: --batch)")
    parser.add_argument("--profile", action="store_true", help="add a profile of 5 steps")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2")
    raise SystemExit(main(parser.parse_args()))
