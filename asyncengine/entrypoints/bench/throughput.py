"""Offline throughput: asyncengine next to transformers' generate, same prompts, same dtype.

    asyncengine bench throughput --batch-sizes 1 8 32 --output-len 128 --prompt-len 100
"""

from __future__ import annotations

import argparse
import random
import time

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be "
         "or has had but not first one their its new after who they have her she two been other "
         "when there all during into school time may years more most only over city some world "
         "would where later up such used many can state about national out known university "
         "united then made system group river house music game century team film").split()


def make_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly ``length`` tokens (random common words)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(length * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:length])
    return prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip transformers (only asyncengine's figures)")
    parser.add_argument("--log-level", default="warning")


def _asyncengine_run(llm, prompts, output_len: int) -> float:
    from asyncengine.core.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return dt


def _hf_run(model, prompts, output_len: int, pad_id: int) -> float:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    dt = time.perf_counter() - t
    assert out.shape[1] - width == output_len
    return dt


def _load_hf(model_arg: str | None, dtype):
    import os

    from transformers import AutoModelForCausalLM

    from asyncengine.executor.weights.loader import resolve_model

    src = resolve_model(model_arg, "auto", None, None)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    m = AutoModelForCausalLM.from_pretrained(src.path if src.gguf_file else os.fspath(src.path),
                                             dtype=dtype, **kw)
    return m.eval()


def main(args: argparse.Namespace) -> int:
    import torch

    from asyncengine.engine.llm import LLM

    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=max(2048, max(args.batch_sizes) * args.prompt_len))
    tok = llm.tokenizer
    hf = None if args.no_baseline else _load_hf(args.model, dtype)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else min(tok.eos_token_ids)
    warm = make_prompts(tok, 2, args.prompt_len, seed=99)
    _asyncengine_run(llm, warm, 8)
    if hf is not None:
        _hf_run(hf, warm, 8, pad)
    print(f"model={llm.engine.model_name} dtype={args.dtype} prompt_len={args.prompt_len} "
          f"output_len={args.output_len} threads={torch.get_num_threads()}")
    print(f"{'batch':>5} {'asyncengine tok/s':>18} {'transformers tok/s':>19} {'ratio':>6}")
    for bsz in args.batch_sizes:
        prompts = make_prompts(tok, bsz, args.prompt_len, seed=bsz)
        llm.engine.scheduler.reset_prefix_cache()
        ours = bsz * args.output_len / _asyncengine_run(llm, prompts, args.output_len)
        if hf is not None:
            theirs = bsz * args.output_len / _hf_run(hf, prompts, args.output_len, pad)
            print(f"{bsz:>5} {ours:>18.1f} {theirs:>19.1f} {ours / theirs:>5.2f}x", flush=True)
        else:
            print(f"{bsz:>5} {ours:>18.1f} {'-':>19} {'-':>6}", flush=True)
    return 0
