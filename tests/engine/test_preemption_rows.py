"""A request preempted by a step that schedules nothing leaves the runner's batch at once.

Found while testing model families: under async scheduling, when a step preempted a request
and scheduled nothing else, the loop dropped that (empty) scheduler output, so the runner
never removed the request's row. Re-admitted later under the same id, the request found its
old row and old block table: its recompute wrote K/V into the blocks it had before, while its
next steps read the new ones, and its greedy tokens went wrong. It took prefix caching and
repeated preemption from a tiny pool to show.
"""

from __future__ import annotations

from asyncengine import LLM, SamplingParams
from tests.engine.test_engine import hf_greedy
from tests.utils import hf_reference_model, make_tiny_model

PROMPTS = ["The capital of France is Paris, and the capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "Once upon a time, in a land far away, there lived a"]


def test_greedy_survives_repeated_preemption_with_prefix_hits(tmp_path):
    d = make_tiny_model(tmp_path / "llama", "llama", initializer_range=0.1)
    hf = hf_reference_model(d)
    llm = LLM(d, dtype="float32", max_model_len=60, block_size=8, num_gpu_blocks_override=10,
              max_num_batched_tokens=16, max_num_seqs=4)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    refs = [hf_greedy(hf, x, 12)[0] for x in ids]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.num_preemptions >= 5 and stats.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
