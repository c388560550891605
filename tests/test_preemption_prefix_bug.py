"""A known bug, found while testing model families (session 8), kept visible until fixed.

Under async scheduling with prefix caching, when a request is preempted several times from a
tiny pool and re-admitted through a prefix hit, its last greedy token can differ from
transformers' (the input token of that step is right; the K/V it attends is not). It does not
happen without prefix caching or with 12 blocks instead of 10; it reproduces on the commit
before the family refactor too, and with the own CPU kernels and the int8 head screen off.
"""

from __future__ import annotations

import pytest

from asyncengine import LLM, SamplingParams
from tests.test_engine import hf_greedy
from tests.utils import hf_reference_model, make_tiny_model

PROMPTS = ["The capital of France is Paris, and the capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "Once upon a time, in a land far away, there lived a"]


@pytest.mark.xfail(strict=True, reason="known bug: a stale K/V after repeated preemption "
                   "and a prefix hit under async scheduling (see the module doc)")
def test_greedy_survives_repeated_preemption_with_prefix_hits(tmp_path):
    d = make_tiny_model(tmp_path / "llama", "llama", initializer_range=0.1)
    hf = hf_reference_model(d)
    llm = LLM(d, dtype="float32", max_model_len=60, block_size=8, num_gpu_blocks_override=10,
              max_num_batched_tokens=16, max_num_seqs=4)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    refs = [hf_greedy(hf, x, 12)[0] for x in ids]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.stats().num_preemptions >= 5
    assert [o.outputs[0].token_ids for o in outs] == refs
