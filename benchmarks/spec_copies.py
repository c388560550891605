"""Does the model copy what the grounded speculative benchmark asks it to copy?

n-gram speculation can only draft what the output copies from the prompt, so the ratio
``benchmarks/spec_decode.py`` measures is bounded by how much of each answer is a copy. This
runs the benchmark's prompts (and, for the code, other phrasings of the same request) through
the model greedily, in process, and prints per prompt whether the answer holds the passage or
the function's body verbatim, and the longest stretch of the answer that is a copy of the
prompt, in tokens.

    python benchmarks/spec_copies.py [--model PATH] [--max-tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_decode import CODE, PASSAGES, grounded_prompts  # noqa: E402

from asyncengine import LLM, SamplingParams  # noqa: E402
from asyncengine.executor.weights.loader import embedded_model_path  # noqa: E402

#: Other ways of asking for the same code edit (the benchmark's own comes first).
CODE_FORMS = {
    "rewrite, keep lines": "Here is a Python function:\n\n```python\n{code}```\n\nRewrite it "
                           "with its name changed to {name}_v2. Keep every other line exactly "
                           "the same.",
    "rename, output all": "Rename the function below to {name}_v2 and output the complete "
                          "code, with every line of the body unchanged.\n\n```python\n{code}```",
    "code first": "```python\n{code}```\n\nCopy this code, changing `def {name}(` to "
                  "`def {name}_v2(`.",
}


def longest_copy(prompt: list[int], answer: list[int]) -> int:
    """The longest run of ``answer``'s tokens found contiguously in ``prompt``."""
    best = 0
    for i in range(len(answer)):
        for j in range(len(prompt)):
            n = 0
            while i + n < len(answer) and j + n < len(prompt) and answer[i + n] == prompt[j + n]:
                n += 1
            best = max(best, n)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model or embedded_model_path(), num_threads=args.threads,
              max_model_len=2048)
    cases: list[tuple[str, str, str]] = []  # (kind, prompt, the text a copy holds)
    for i, prompt in enumerate(grounded_prompts(2 * len(PASSAGES), offset=1000)):
        if i % 2 == 0:
            cases.append(("passage (benchmark)", prompt, PASSAGES[(i // 2) % len(PASSAGES)]))
        else:
            name, code = CODE[(i // 2) % len(CODE)]
            cases.append((f"{name} (benchmark)", prompt, code.split("\n", 1)[1].strip()))
    for form, text in CODE_FORMS.items():
        for name, code in CODE:
            cases.append((f"{name} ({form})", text.format(name=name, code=code),
                          code.split("\n", 1)[1].strip()))
    outs = llm.chat([[{"role": "user", "content": p}] for _, p, _ in cases],
                    SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    print(f"{'prompt':38s} {'copied':>6s} {'tokens':>6s} {'longest copy':>12s}")
    for (kind, _, wanted), out in zip(cases, outs, strict=True):
        o = out.outputs[0]
        copied = "yes" if wanted in o.text else "no"
        run = longest_copy(list(out.prompt_token_ids), list(o.token_ids))
        print(f"{kind:38s} {copied:>6s} {len(o.token_ids):6d} {run:12d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
