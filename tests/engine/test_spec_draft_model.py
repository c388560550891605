"""The draft_model method: a draft model of the same vocabulary in the same process and step
loop; greedy output identical to the target's alone."""

from __future__ import annotations

import json

import anyio
import pytest

from asyncengine import SamplingParams
from tests.spec_utils import SpecCounter, generate_all, make_engine, pool_is_free
from tests.utils import make_tiny_model

PROMPTS = ["1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2", "def f(x): return x; def f(x):"]


def _spec(model: str, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def larger_target(tmp_path_factory) -> str:
    """A random target twice the draft's width, more layers, the same tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", hidden_size=128,
                           intermediate_size=256, num_hidden_layers=3)


async def _run(model: str, spec: str | None) -> tuple[list[list[int]], SpecCounter | None]:
    engine = make_engine(model, spec=spec)
    counter = SpecCounter(engine) if spec else None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    async with engine:
        outs = await generate_all(engine, PROMPTS, params)
        assert pool_is_free(engine)
        if spec:
            proposer = engine.loop.drafting.proposer
            assert proposer.num_steps > 0
    return [o.outputs[0].token_ids for o in outs], counter


def test_a_small_random_draft_beside_a_larger_target_is_greedy_equal(tiny_llama,
                                                                       larger_target):
    async def main():
        ref, _ = await _run(larger_target, None)
        got, counter = await _run(larger_target, _spec(tiny_llama))
        assert got == ref
        assert counter.steps > 5 and counter.drafts > 0  # random weights: few accepted

    anyio.run(main)


def test_the_target_as_its_own_draft_is_accepted_almost_always(tiny_llama):
    async def main():
        ref, _ = await _run(tiny_llama, None)
        got, counter = await _run(tiny_llama, _spec(tiny_llama, 4))
        assert got == ref
        assert counter.accepted >= 0.9 * counter.drafts > 0

    anyio.run(main)


def test_a_draft_of_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=1000)
    with pytest.raises(ValueError, match="--speculative-config.*vocabulary"):
        make_engine(tiny_llama, spec=_spec(other))


def test_sleep_level_1_frees_the_drafts_cache_too_and_waking_gives_the_same_tokens(tiny_llama):
    """Level 1 on the CPU frees the KV caches and keeps the weights: the draft model's cache
    goes with the target's (engine_bytes counts both), and after waking the output is the
    same."""
    from asyncengine.engine.sleep import KVSleep, engine_bytes

    async def main():
        engine = make_engine(tiny_llama, spec=_spec(tiny_llama, 3))
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        async with engine:
            before = [o.outputs[0].token_ids for o in await generate_all(engine, PROMPTS,
                                                                         params)]
            draft = engine.loop.drafting.proposer.runner
            awake = engine_bytes(engine)
            cache = sum(c.numel() * c.element_size()
                        for r in (engine.runner, draft) for c in r.kv_caches)
            state = KVSleep.release(engine)
            assert state is not None and len(state.layers) == 2
            assert engine.runner.kv_caches == [] and draft.kv_caches == []
            assert engine_bytes(engine) == awake - cache
            state.restore(engine)
            assert engine_bytes(engine) == awake
            after = [o.outputs[0].token_ids for o in await generate_all(engine, PROMPTS,
                                                                        params)]
            assert pool_is_free(engine)
        assert after == before

    anyio.run(main)
