"""The draft_model method on random weights: a small draft beside a larger target of the same
vocabulary (both made here with transformers, SmolLM2's tokenizer), greedy, concurrency 1.
Random weights accept little: this shows exactness (the tokens are compared) and what a
rejected draft costs, against the same target without drafts, in one run.

    python benchmarks/spec_draft_model.py [--target-hidden 256] [--target-layers 6] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncengine import SamplingParams  # noqa: E402
from asyncengine.config import EngineConfig  # noqa: E402
from asyncengine.engine.engine import AsyncEngine  # noqa: E402
from tests.utils import make_tiny_model  # noqa: E402

PROMPTS = ["Repeat after me: the quick brown fox jumps over the lazy dog.",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):"]


async def run(target: str, spec: str | None, max_tokens: int) -> tuple[list, float, dict]:
    values = {"model": target, "dtype": "float32", "max_model_len": 512,
              "num_gpu_blocks_override": 256, "block_size": 16}
    if spec:
        values["speculative_config"] = spec
    engine = AsyncEngine(EngineConfig.from_dict(values))
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    real = engine.scheduler.update_from_output

    def update(out, result):
        for s in out.scheduled:
            tokens = result.spec_token_ids.get(s.request.request_id)
            if s.spec_token_ids and tokens is not None:
                counts["drafts"] += 1
                counts["draft_tokens"] += len(s.spec_token_ids)
                counts["accepted"] += len(tokens) - 1
        return real(out, result)

    engine.scheduler.update_from_output = update
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs, elapsed = [], 0.0
    async with engine:
        async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4)):
            pass  # warm-up
        for p in PROMPTS:
            start = time.perf_counter()
            last = None
            async for out in engine.generate(p, params):
                last = out
            elapsed += time.perf_counter() - start
            outs.append(last.outputs[0].token_ids)
    return outs, elapsed, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-hidden", type=int, default=256)
    parser.add_argument("--target-layers", type=int, default=6)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spec-draft-"))
    target = make_tiny_model(root / "target", "llama", hidden_size=args.target_hidden,
                             intermediate_size=4 * args.target_hidden,
                             num_hidden_layers=args.target_layers, num_attention_heads=8,
                             num_key_value_heads=4)
    draft = make_tiny_model(root / "draft", "llama")  # hidden 64, 2 layers
    spec = json.dumps({"method": "draft_model", "model": draft,
                       "num_speculative_tokens": args.k})
    own = json.dumps({"method": "draft_model", "model": target,
                      "num_speculative_tokens": args.k})

    async def both():
        return [await run(target, s, args.max_tokens) for s in (None, spec, own)]

    (ref, t0, _), (got, t1, c1), (got2, t2, c2) = anyio.run(both)
    n = sum(len(o) for o in ref)
    print(f"target: llama hidden {args.target_hidden}, {args.target_layers} layers; draft: "
          f"hidden 64, 2 layers; vocab 49152; k={args.k}; greedy, c=1, {n} tokens")
    for name, t, c, out in (("no drafts", t0, None, ref), ("random draft", t1, c1, got),
                            ("target as its own draft", t2, c2, got2)):
        acc = ""
        if c:
            acc = (f"  acceptance {100 * c['accepted'] / max(c['draft_tokens'], 1):.1f}%, "
                   f"length {1 + c['accepted'] / max(c['drafts'], 1):.2f}")
        print(f"{name:26s} {n / t:8.1f} tok/s  {t0 / t:5.2f}x  greedy-equal: {out == ref}"
              f"{acc}")
    return 0 if got == ref and got2 == ref else 1


if __name__ == "__main__":
    raise SystemExit(main())
