"""Everything keeps working with speculation on: logprobs of accepted tokens, stop strings and
tokens, max_tokens/min_tokens, n > 1, seeds, structured outputs, a request that does not
speculate beside ones that do (async scheduling), prefix caching, preemption, aborts,
metrics. Each run is compared with the same run without speculation; drafts come from an
oracle of that run with corruptions, so each feature meets accepted and rejected drafts."""

from __future__ import annotations

import json

import anyio

from asyncengine import SamplingParams
from asyncengine.core.sampling_params import StructuredOutputsParams
from asyncengine.engine.metrics import EngineMetrics
from tests.spec_utils import Oracle, SpecCounter, generate_all, make_engine, pool_is_free

PROMPTS = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2", "The capital of France is",
           "a b c a b c a b", "def f(x): return x; def f(x):"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _summary(out) -> list[tuple]:
    rows = []
    for c in out.outputs:
        lps = None
        if c.logprobs is not None:
            lps = [sorted((t, round(lp.logprob, 3)) for t, lp in pos.items())
                   for pos in c.logprobs]
        rows.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps))
    return rows


def test_every_sampling_feature_gives_the_same_output_with_drafts(tiny_llama):
    async def main():
        base = make_engine(tiny_llama, spec=None)
        async with base:
            pre = await generate_all(base, PROMPTS, SamplingParams(temperature=0, max_tokens=30,
                                                                   ignore_eos=True))
            pre_ids = [o.outputs[0].token_ids for o in pre]
            stop_text = base.tokenizer.decode(pre_ids[2][10:13]).strip()
            params = [
                SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[pre_ids[1][12]]),
                SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
                SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                               stop_token_ids=[pre_ids[3][4]]),
                SamplingParams(temperature=0.8, seed=123, n=2, max_tokens=20, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=40, structured_outputs=(
                    StructuredOutputsParams(json=SCHEMA))),
                SamplingParams(temperature=0, max_tokens=13, repetition_penalty=1.3),
            ]
            prompts = PROMPTS + PROMPTS[:3]
            ref = await generate_all(base, prompts, params)

        engine = make_engine(tiny_llama)
        engine.metrics = EngineMetrics()
        tok = engine.tokenizer
        oracle = Oracle([tok.encode(p) + list(c.token_ids)
                         for p, o in zip(prompts, ref, strict=True) for c in o.outputs])
        engine.loop.drafting.proposer = oracle
        counter = SpecCounter(engine)
        async with engine:
            got = await generate_all(engine, prompts, params)
            assert pool_is_free(engine)
        for i, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert _summary(a) == _summary(b), (i, params[i])
        assert counter.steps > 20 and 0 < counter.accepted < counter.drafts
        # The stop conditions really ended those requests early.
        assert ref[1].outputs[0].finish_reason == "stop" and len(ref[1].outputs[0].token_ids) <= 13
        assert ref[2].outputs[0].finish_reason == "stop"
        assert len(ref[3].outputs[0].token_ids) >= 10
        assert len(ref[6].outputs[0].token_ids) == 13
        json.loads(got[5].outputs[0].text) if got[5].outputs[0].finish_reason == "stop" else None
        m = engine.metrics
        assert m.spec_num_drafts == counter.steps
        assert m.spec_num_draft_tokens == counter.drafts
        assert m.spec_num_accepted_tokens == counter.accepted
        assert m.spec_accepted_per_pos[0] >= m.spec_accepted_per_pos[-1] > 0
        text = m.render().decode()
        for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                     "vllm:spec_decode_num_accepted_tokens_total"):
            assert name in text
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name=' in text
        assert 'position="0"' in text

    anyio.run(main)


def test_preemption_prefix_caching_and_aborts_with_drafts(tiny_llama):
    """A KV cache too small for the batch preempts requests that have drafts; a second run of
    the same prompts hits the prefix cache; an abort mid-stream frees everything."""
    prompts = [p + " and so on, again and again" for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = {"num_gpu_blocks_override": 26}

    async def main():
        base = make_engine(tiny_llama, spec=None, **small)
        async with base:
            ref = [o.outputs[0].token_ids for o in await generate_all(base, prompts, params)]
        engine = make_engine(tiny_llama, **small)
        tok = engine.tokenizer
        engine.loop.drafting.proposer = Oracle(
            [tok.encode(p) + r for p, r in zip(prompts, ref, strict=True)], seed=1)
        counter = SpecCounter(engine)
        async with engine:
            got = [o.outputs[0].token_ids for o in await generate_all(engine, prompts, params)]
            assert engine.scheduler.make_stats().num_preemptions > 0
            assert got == ref and pool_is_free(engine)
            hits = engine.scheduler.make_stats().prefix_cache_hits
            again = await generate_all(engine, prompts[:2], params)
            assert [o.outputs[0].token_ids for o in again] == ref[:2]
            assert engine.scheduler.make_stats().prefix_cache_hits > hits
            async for out in engine.generate(prompts[3], params):
                if len(out.outputs[0].token_ids) >= 6:
                    break  # leaves the stream: the request is aborted
            await anyio.sleep(0.2)
            assert engine.scheduler.get_num_unfinished_requests() == 0
            assert pool_is_free(engine)
        assert counter.accepted > 0

    anyio.run(main)
