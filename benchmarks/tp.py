"""Tensor parallelism on the CPU: throughput at TP=1 and TP=2, and what communication costs.

A Llama-shaped model with random weights (``--load-format dummy``; hidden --hidden, --layers
layers, 8 heads, 4 KV heads, vocabulary 49152, the embedded tokenizer) serves --requests
greedy requests of --prompt-len prompt tokens and --max-tokens output tokens through the
offline ``LLM``, once per TP size. Per size it prints the output tokens per second, the steps,
and rank 0's time per step in the device thread, in the model group's collectives (2 all-reduces
per layer, 1 for the embedding, the logits gather; the time includes waiting for the slower
rank) and broadcasting the step message. Usage:

    OMP_NUM_THREADS=1 python benchmarks/tp.py [--tp 1 2] [--requests 16] [--max-tokens 32]
        [--prompt-len 64] [--hidden 512] [--layers 8] [--num-threads T]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def make_model(directory: Path, hidden: int, layers: int) -> str:
    import transformers

    from tests.utils import embedded_tokenizer_dir

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    for f in embedded_tokenizer_dir().iterdir():
        shutil.copy(f, directory / f.name)
    return str(directory)


def run(path: str, tp: int, args: argparse.Namespace) -> dict:
    from asyncengine import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", dtype=args.dtype, tensor_parallel_size=tp,
              max_num_seqs=args.requests, max_model_len=512, num_threads=args.num_threads)
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(args.prompt_len)]
               for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine, runner = llm.engine, llm.engine.runner
    steps0, busy0 = engine.loop.num_steps, engine.device.busy_s
    tp_state = getattr(runner, "tp", None)
    comm0 = tp_state.comm_s if tp_state else 0.0
    coll0 = tp_state.num_collectives if tp_state else 0
    msg0 = getattr(runner, "message_s", 0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = engine.loop.num_steps - steps0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "tp": tp, "tok_s": tokens / wall, "wall_s": wall, "steps": steps,
        "device_ms_per_step": 1e3 * (engine.device.busy_s - busy0) / steps,
        "comm_ms_per_step": 1e3 * ((tp_state.comm_s - comm0) if tp_state else 0.0) / steps,
        "collectives_per_step": ((tp_state.num_collectives - coll0) if tp_state else 0) / steps,
        "message_ms_per_step": 1e3 * (getattr(runner, "message_s", 0.0) - msg0) / steps,
    }
    engine.shutdown()
    return result


def _allreduce_rank(rank: int, init: str, rows: list[int], hidden: int, iters: int,
                    out: object) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    for n in rows:
        x = torch.randn(n, hidden)
        for _ in range(10):
            dist.all_reduce(x)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if rank == 0:
            out.put((n, (time.perf_counter() - start) / iters))
    dist.destroy_process_group()


def allreduce_latency(hidden: int, rows: list[int], iters: int = 200) -> list[tuple[int, float]]:
    """Seconds per gloo all-reduce of a float32 [rows, hidden] tensor between two processes
    of this machine, both idle otherwise: the pure cost of one collective."""
    import multiprocessing

    from asyncengine.executor.parallel.state import free_init_method

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = free_init_method()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, init, rows, hidden, iters, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in rows]
    for p in procs:
        p.join()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="CPU threads per rank (default: the cores shared by the ranks)")
    parser.add_argument("--allreduce", action="store_true",
                        help="also time one gloo all-reduce of [rows, hidden] alone")
    args = parser.parse_args()
    if args.allreduce:
        for n, sec in allreduce_latency(args.hidden, [1, args.requests, 256]):
            print(f"gloo all-reduce of [{n}, {args.hidden}] float32: {1e6 * sec:.0f} us",
                  flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp), args.hidden, args.layers)
        for tp in args.tp:
            r = run(path, tp, args)
            print(f"TP={r['tp']}: {r['tok_s']:.1f} output tok/s ({r['wall_s']:.2f}s, "
                  f"{r['steps']} steps); device {r['device_ms_per_step']:.2f} ms/step, of which "
                  f"collectives {r['comm_ms_per_step']:.2f} ms "
                  f"({r['collectives_per_step']:.1f} per step) and the step message "
                  f"{r['message_ms_per_step']:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
