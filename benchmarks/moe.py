"""Mixture-of-experts decode speed: a Qwen3-MoE-shaped model against a dense model of the same
active parameter count, and both against transformers.

Random weights (``--load-format dummy``), the embedded tokenizer. The MoE model is
Qwen3-MoE's shape scaled down to a 2-core CPU: --experts experts (64), top --top-k (8), each
expert an MLP of --expert-intermediate (128) over hidden --hidden (512), --layers layers
(8), 8 heads of 64, 4 KV heads, q/k norms, tied embeddings, a vocabulary of --vocab (8192:
the first ids of the embedded tokenizer's; prompt ids stay below it). The dense model is the same
Qwen3 with one MLP of ``top_k * expert_intermediate``: the same parameters per token
(the router's ``experts x hidden`` aside). Per model and concurrency (--batch: 1 and 32) it
prints decode tokens per second: asyncengine's decode steps measured directly (scheduler,
runner, update; prompts of --prompt-len tokens prefilled first; the best and the median of
--steps steps), and transformers' own forward with its KV cache over the same shapes (float32
rows only). The figure the issue asks for is the MoE / dense ratio at equal active parameters,
like with like: each --quantization row quantizes both models the same way (float32, or int8 /
int4 for every linear layer and the experts). Usage:

    python benchmarks/moe.py [--batch 1 32] [--steps 20] [--experts 64] [--top-k 8]
        [--hidden 512] [--expert-intermediate 128] [--layers 8] [--no-hf]
        [--quantization none int8 int4] [--dtype float32|bfloat16] [--num-threads N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def make_models(root: Path, args: argparse.Namespace) -> dict[str, str]:
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/
    from tests.utils import embedded_tokenizer_dir

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2)
    configs = {
        "moe": transformers.Qwen3MoeConfig(
            **common, intermediate_size=args.top_k * args.expert_intermediate,
            moe_intermediate_size=args.expert_intermediate, num_experts=args.experts,
            num_experts_per_tok=args.top_k, norm_topk_prob=True),
        "dense": transformers.Qwen3Config(
            **common, intermediate_size=args.top_k * args.expert_intermediate),
    }
    paths = {}
    for name, config in configs.items():
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        directory = root / name
        config.save_pretrained(directory)
        for f in embedded_tokenizer_dir().iterdir():
            shutil.copy(f, directory / f.name)
        paths[name] = str(directory)
    return paths


def ours(path: str, batch: int, args: argparse.Namespace,
         quantization: str) -> tuple[float, float]:
    """(best, median) decode step seconds of asyncengine at ``batch`` requests."""
    from asyncengine.config import EngineConfig
    from asyncengine.core.request import Request
    from asyncengine.core.sampling_params import SamplingParams
    from asyncengine.executor.build import build

    options = {"model": path, "dtype": args.dtype, "load_format": "dummy",
               "max_num_seqs": batch, "max_model_len": 1024}
    if quantization != "none":
        options["quantization"] = quantization
    if args.num_threads:
        options["num_threads"] = args.num_threads
    parts = build(EngineConfig.from_dict(options))
    scheduler = parts.make_scheduler()
    params = SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True)
    for i in range(batch):
        scheduler.add_request(Request(f"r{i}", [(7 * i + j) % 8000 + 100
                                               for j in range(args.prompt_len)], params,
                                      max_model_len=parts.max_model_len))

    def step() -> int:
        out = scheduler.schedule()
        inputs = parts.runner.prepare(out)
        result = parts.runner.execute(inputs).finish()
        scheduler.update_from_output(out, result)
        return len(result.sampled_token_ids)

    while step() < batch:  # the prefills
        pass
    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def theirs(path: str, batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """(best, median) decode step seconds of transformers' forward with its KV cache."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.tensor([[(7 * i + j) % 8000 + 100 for j in range(args.prompt_len)]
                        for i in range(batch)])
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(3 + min(args.steps, 10)):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if i >= 3:
                times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main(args: argparse.Namespace) -> int:
    import torch

    root = Path(tempfile.mkdtemp(prefix="ae-moe-bench-"))
    try:
        paths = make_models(root, args)
        for quantization in args.quantization:
            for batch in args.batch:
                result = {}
                for name in ("moe", "dense"):
                    best, median = ours(paths[name], batch, args, quantization)
                    result[name] = batch / best, batch / median
                    line = (f"{quantization:4s} batch {batch:3d} {name:5s} asyncengine: "
                            f"{batch / best:8.1f} tok/s best ({batch / median:.1f} median)")
                    if not args.no_hf and quantization == "none":
                        hf_best, hf_median = theirs(paths[name], batch, args)
                        line += (f"   transformers: {batch / hf_best:8.1f} tok/s best "
                                 f"({batch / hf_median:.1f} median), asyncengine "
                                 f"{hf_best / best:.2f}x")
                    print(line, flush=True)
                ratio = result["moe"][0] / result["dense"][0]
                print(f"{quantization:4s} batch {batch:3d} MoE / dense at equal active "
                      f"parameters: {ratio:.2f}x (best steps; medians "
                      f"{result['moe'][1] / result['dense'][1]:.2f}x)", flush=True)
        print(f"threads={args.num_threads or torch.get_num_threads()} experts={args.experts} "
              f"top_k={args.top_k} "
              f"hidden={args.hidden} expert_intermediate={args.expert_intermediate} "
              f"layers={args.layers} dtype={args.dtype}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-intermediate", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192,
                   help="the logits head's rows (Qwen3-MoE's head is ~10%% of its active "
                        "parameters; at 49152 here it would be most of them)")
    p.add_argument("--quantization", nargs="+", default=["none"],
                   choices=["none", "int8", "int4"],
                   help="each a row: both models' weights (dense and experts) so quantized")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="asyncengine's weights and activations (transformers stays float32)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--num-threads", type=int, default=0, help="compute threads (0: the cores)")
    raise SystemExit(main(p.parse_args()))
