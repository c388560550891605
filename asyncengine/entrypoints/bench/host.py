"""``asyncengine bench host``: the host's work per step on the CUDA step path, on any machine.

GPUs are lent rarely; the host's side of a GPU step is Python on the loop's thread, and
that runs anywhere. This runs the real engine on its CUDA step path — the persistent batch,
FlashInfer's paged plans (through the stand-in module), CUDA-graph replays of decode steps
(emulated), the CUDA device enqueueing from the loop and awaiting events — against a
simulated GPU: a stream that completes each forward pass ``T_gpu`` after the later of its
launch and the end of the one before (``executor/runtime/simulated.py``), and a model
whose forward pass costs the host one small op (``simulated_gpu.SimulatedModel``).

It prints, for each number of streams and consumer mode (``host_consumers.py``), the loop
thread's CPU per step and per stream per step, split by phase (schedule, prepare, enqueue,
update, emit and SSE, consumers, the rest: ``host_probe.py``), and the simulated GPU's idle
time between full-batch steps (as ``benchmarks/gpu.py`` measures it on a GPU) and over the
whole run. ``T_gpu`` defaults to a model of the Llama-3.2-1B shape on an H100 fitted to the
measured steps of docs/gpu.md; docs/gpu.md also has this machine's factor against the H100's
host, and what the proxy cannot see.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from asyncengine.entrypoints.bench.host_consumers import MODES, NOT_BUILT, prompt_ids
from asyncengine.entrypoints.bench.overhead import TINY_CONFIG, make_model_dir

#: The 1B shape's decode step on an H100 (docs/gpu.md, 2026-11-27, fused layer ops): 2.120
#: ms at batch 1 and 3.33 ms at batch 256, as a fixed part plus a part per token.
H100_1B_FIXED_MS = 2.1153
H100_1B_PER_TOKEN_US = 4.745
#: The simulated vocabulary: SmolLM2's ids 272..511 are whole ASCII pieces (" the", "ing").
VOCAB, FIRST_TOKEN = 512, 272
ENGINE_MODEL = {**TINY_CONFIG, "vocab_size": VOCAB, "num_hidden_layers": 1,
                "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                "num_key_value_heads": 1, "max_position_embeddings": 4096}
PHASE_COLUMNS = ("schedule", "prepare", "enqueue", "update", "emit", "consumers", "rest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 256, 1024],
                        help="concurrent streams, one engine each (default: 1 32 256 1024)")
    parser.add_argument("--consumers", nargs="+", default=["http", "generate"],
                        choices=[*MODES, *NOT_BUILT],
                        help="who reads the streams (default: http generate; batch: one "
                             "task reading them all through generate_many)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="output tokens per stream (default: 128)")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="prompt tokens per stream (default: 128)")
    parser.add_argument("--t-gpu-ms", type=float, default=None,
                        help="GPU time per forward pass, ms: alone, a constant; with "
                             f"--t-gpu-per-token-us, the fixed part (default: the 1B shape on "
                             f"an H100, {H100_1B_FIXED_MS} ms + {H100_1B_PER_TOKEN_US} us per "
                             "token)")
    parser.add_argument("--t-gpu-per-token-us", type=float, default=None,
                        help="GPU time per token of a forward pass, us (a CUDA graph's "
                             "tokens are its batch size)")
    parser.add_argument("--await", dest="await_mechanism", choices=["thread", "poll"],
                        default=None, help="how the loop awaits a step's event (default: "
                                           "ASYNCENGINE_CUDA_AWAIT, else thread)")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="leave the garbage collector as Python sets it (default: tuned as "
                             "`asyncengine serve` tunes it, engine/gc_policy.py)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each (streams, consumers), alternating the consumers")
    parser.add_argument("--json", default=None, help="also write the rows to this file")


def step_time(args: argparse.Namespace) -> Any:
    from asyncengine.executor.runtime.simulated_gpu import StepTime

    if args.t_gpu_ms is None and args.t_gpu_per_token_us is None:
        return StepTime(H100_1B_FIXED_MS / 1e3, H100_1B_PER_TOKEN_US / 1e6)
    if args.t_gpu_per_token_us is None:
        return StepTime(args.t_gpu_ms / 1e3)
    fixed = H100_1B_FIXED_MS if args.t_gpu_ms is None else args.t_gpu_ms
    return StepTime(fixed / 1e3, args.t_gpu_per_token_us / 1e6)


def make_engine(model_dir: str, streams: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """An engine for ``streams`` streams on the simulated GPU; (engine, its probe)."""
    import torch

    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.gc_policy import tune_for_serving
    from asyncengine.entrypoints.bench.host_probe import Probe
    from asyncengine.executor.runtime.simulated import SimulatedCUDA
    from asyncengine.executor.runtime.simulated_gpu import SimulatedModel, on_simulated_gpu

    block = 16
    per_stream = -(-(args.prompt_tokens + args.tokens + 1) // block) + 1
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": model_dir, "load_format": "dummy", "dtype": "float32", "block_size": block,
        "max_num_seqs": streams, "max_num_batched_tokens": 8192, "max_model_len": 4096,
        "num_gpu_blocks_override": streams * per_stream + 64, "num_threads": 1}))
    torch.set_num_threads(1)  # the loop's small ops stand for launches: no OpenMP team
    model = SimulatedModel.like(engine.runner.model, step_time(args), FIRST_TOKEN)
    on_simulated_gpu(engine, graphs=True, awaiter=args.await_mechanism,
                     cuda=SimulatedCUDA(delay=0.0), model=model)
    if args.gc_freeze:  # as `asyncengine serve` does once it serves
        tune_for_serving()
    return engine, Probe(engine, engine.device.stream)


def measure(engine: Any, probe: Any, mode: str, streams: int,
            args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    from asyncengine.entrypoints.bench.host_probe import bare_wakeup_s, split
    from asyncengine.executor.runtime.simulated import gpu_idle

    prompts = [prompt_ids(i, args.prompt_tokens, FIRST_TOKEN, VOCAB) for i in range(streams)]
    warmup = [prompt_ids(i, args.prompt_tokens, FIRST_TOKEN, VOCAB, salt=1)
              for i in range(streams)]
    consumers = MODES[mode]()
    before, after, delivered, extra = anyio.run(consumers.run, engine, probe, prompts, warmup,
                                                args.tokens)
    cpu = split(before, after, (probe.tasks.inside_s, probe.tasks.added_s))
    steps = after["steps"] - before["steps"]
    stream_steps = after["stream_steps"] - before["stream_steps"]
    wall = after["wall_s"] - before["wall_s"]
    records = probe.stream.records[before["records"]:after["records"]]
    full, run = gpu_idle(records, tokens=streams), gpu_idle(records)
    t_gpu = probe.engine.runner.model.step_time(streams)
    loop_per_step = cpu["total"] / max(steps, 1)
    return {
        "consumers": mode, "streams": streams, "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "steps": steps, "stream_steps": stream_steps,
        "wall_s": wall, "tokens_per_s": sum(delivered) / wall,
        "delivered": sum(delivered), "expected": streams * args.tokens,
        "blocks_free_after": engine.num_free_blocks == engine.num_total_blocks,
        "cpu_s": cpu,
        "ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in cpu.items()},
        "us_per_stream_step": {k: 1e6 * v / max(stream_steps, 1) for k, v in cpu.items()},
        "gc_ms_per_step": 1e3 * (after["gc_s"] - before["gc_s"]) / max(steps, 1),
        # The loop's CPU per stream-step in bare asyncio wake-ups (host_probe.bare_wakeup_s).
        "wakeups_per_stream_step": cpu["total"] / max(stream_steps, 1) / bare_wakeup_s(),
        "process_us_per_stream_step": 1e6 * (after["process_cpu_s"] - before["process_cpu_s"])
        / max(stream_steps, 1),
        "gpu": {"t_gpu_ms": 1e3 * t_gpu,
                "full_batch_steps": full.steps, "period_ms": 1e3 * full.median_period_s,
                "idle_percent": full.idle_percent, "run_idle_percent": run.idle_percent,
                # What the idle would be with a core for the loop: its CPU per step is then
                # the period whenever it exceeds T_gpu.
                "one_core_idle_percent": 100 * max(0.0, 1 - t_gpu / loop_per_step)},
        **extra,
    }


def main(args: argparse.Namespace) -> int:
    modes = [m for m in args.consumers if m in MODES]
    print(header(args))
    for m in args.consumers:
        if m in NOT_BUILT:
            print(f"consumers {m}: left out: {NOT_BUILT[m]}")
    import torch

    rows: list[dict[str, Any]] = []
    threads = torch.get_num_threads()  # make_engine runs torch on one thread: given back
    threshold = gc.get_threshold()  # and tunes the collector as a server: given back too
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model_dir(Path(tmp) / "model", ENGINE_MODEL)
            for n in args.streams:
                engine, probe = make_engine(model_dir, n, args)
                for _ in range(args.repeat):
                    for mode in modes:
                        rows.append(measure(engine, probe, mode, n, args))
                        print(format_row(rows[-1]), flush=True)
                probe.close()
                del engine, probe
                gc.unfreeze()
                gc.set_threshold(*threshold)
                gc.collect()
    finally:
        torch.set_num_threads(threads)
        gc.set_threshold(*threshold)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def header(args: argparse.Namespace) -> str:
    t = step_time(args)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"asyncengine bench host: the CUDA step path against a simulated GPU; T_gpu per "
            f"forward pass {1e3 * t.fixed_s:.3f} ms + {1e6 * t.per_token_s:.3f} us/token; "
            f"{args.prompt_tokens} prompt and {args.tokens} output tokens per stream; "
            f"{os.cpu_count()} CPUs, load average {load}")


def format_row(r: dict[str, Any]) -> str:
    us, g = r["us_per_stream_step"], r["gpu"]
    return (f"{r['consumers']:>8} {r['streams']:>5} streams: {r['steps']} steps, "
            f"{r['ms_per_step']['total']:.3f} ms/step, {us['total']:.1f} us/stream/step; "
            f"GPU idle {g['idle_percent']:.1f}% (full batch, T_gpu {g['t_gpu_ms']:.2f} ms, "
            f"period {g['period_ms']:.2f} ms), {g['run_idle_percent']:.1f}% (run), "
            f"{g['one_core_idle_percent']:.1f}% (a core for the loop); "
            f"{r['tokens_per_s']:.0f} tok/s; {r['delivered']}/{r['expected']} tokens; "
            f"gc {r['gc_ms_per_step']:.3f} ms/step; "
            f"{r['wakeups_per_stream_step']:.1f} bare wake-ups per stream-step")


def table(rows: list[dict[str, Any]]) -> str:
    """Per mode: the loop thread's ms per step and us per stream-step, by phase; the GPU."""
    from asyncengine.entrypoints.bench.host_probe import bare_wakeup_s

    names = ("total", *PHASE_COLUMNS)
    heads = ("total", "sched", "prep", "enq", "update", "emit", "cons", "rest")
    lines = []
    for mode in dict.fromkeys(r["consumers"] for r in rows):
        lines += [f"consumers: {mode} ({MODES[mode].description})",
                  f"{'':>7} | {'loop thread CPU, ms per step':^55} | "
                  f"{'us per stream per step':^47} | {'simulated GPU, full-batch steps':^37}",
                  f"{'streams':>7} | " + " ".join(f"{h:>6}" for h in heads) + " | "
                  + " ".join(f"{h:>5}" for h in heads)
                  + " | T_gpu ms period ms idle % 1 core % | tok/s  gc ms  wk"]
        for r in (r for r in rows if r["consumers"] == mode):
            ms, us, g = r["ms_per_step"], r["us_per_stream_step"], r["gpu"]
            lines.append(f"{r['streams']:>7} | " + " ".join(f"{ms[k]:>6.3f}" for k in names)
                         + " | " + " ".join(f"{us[k]:>5.1f}" for k in names)
                         + f" | {g['t_gpu_ms']:>8.2f} {g['period_ms']:>9.2f} "
                           f"{g['idle_percent']:>6.1f} {g['one_core_idle_percent']:>8.1f} | "
                           f"{r['tokens_per_s']:>6.0f} {r['gc_ms_per_step']:>6.3f} "
                           f"{r['wakeups_per_stream_step']:>4.1f}")
        lines.append("")
    lines.append("emit: emission with the SSE writes and their flush; cons: every task but the "
                 "step loop's; idle %: measured between full-batch steps; 1 core %: "
                 "1 - T_gpu / the loop's CPU per step; gc ms: the loop thread's garbage "
                 "collections per step, inside the phases; wk: the loop's CPU per stream-step "
                 "in bare asyncio wake-ups (an Event set and its task's step: "
                 f"{1e6 * bare_wakeup_s():.2f} us here)")
    for m, why in NOT_BUILT.items():
        lines.append(f"consumers: {m}: not measured, {why}")
    return "\n".join(lines)
