"""With async scheduling (always on), greedy tokens equal transformers' for every model
family, with everything that touches a request between two steps running at once in one
engine: chunked prefill, preemption from a small block pool, prefix-cache hits, stop strings,
``n > 1`` with logprobs, a structured-output constraint (its mask for step N+1 needs step N's
token), and requests aborted while their step is on the device."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import StructuredOutputsParams
from asyncengine.engine.engine import AsyncEngine
from tests.engine.test_engine import hf_greedy
from tests.utils import make_tiny_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time, in a land far away, there lived a"]
N = 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "mistral", "mistral")


@pytest.fixture(params=["llama", "qwen2", "qwen3", "mistral"])
def family_model(request, tiny_models) -> str:
    if request.param == "mistral":
        return request.getfixturevalue("mistral")
    return tiny_models[request.param]


def _clean_prefix(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """The longest prefix of ``tokens`` (at least 4) whose text round-trips: no special
    token, no broken UTF-8. Returns its length and text."""
    special = set(tokenizer.hf.all_special_ids)
    k = len(tokens)
    while k > 4:
        text = tokenizer.decode(tokens[:k])
        if not special & set(tokens[:k]) and "\ufffd" not in text:
            return k, text
        k -= 1
    pytest.skip("the random model's greedy text has no clean prefix")


def test_greedy_equals_transformers_under_async_scheduling(family_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(family_model, dtype=torch.float32).eval()
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": family_model, "dtype": "float32", "max_num_seqs": 8,
        "max_num_batched_tokens": 24, "block_size": 8, "num_gpu_blocks_override": 14,
        "max_model_len": 128}))
    tok = engine.tokenizer
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    refs = [hf_greedy(hf, ids, N) for ids in prompt_ids]
    texts = [tok.decode(r[0]) for r in refs]
    # A stop string from the middle of prompt 2's greedy text; the text stops before it.
    stop = texts[2][len(texts[2]) // 2:][:3]
    stop_expected = texts[2][:texts[2].index(stop)]
    # A choice that is exactly prompt 3's greedy text (a clean prefix of it): each greedy token
    # is allowed by the grammar, so the constrained argmax is transformers' argmax.
    k, choice = _clean_prefix(tok, refs[3][0])

    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    results: dict[str, object] = {}
    dropped: list[int] = []

    async def run(key: str, ids: list[int], params: SamplingParams) -> None:
        async for out in engine.generate(ids, params):
            results[key] = out

    async def drop(ids: list[int], after: int) -> None:
        async for out in engine.generate(ids, SamplingParams(max_tokens=50, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= after:
                dropped.append(sum(1 for step in engine.loop.in_flight for s in step.out.scheduled
                                   if s.request.request_id == out.request_id))
                break  # leaving the stream aborts the request, mid-step

    async def main() -> None:
        async with engine:
            for rnd in range(2):  # the second round hits the prefix cache
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run, f"plain0-{rnd}", prompt_ids[0], greedy)
                    tg.start_soon(run, f"n2-{rnd}", prompt_ids[1], SamplingParams(
                        n=2, temperature=0, max_tokens=N, ignore_eos=True, logprobs=1))
                    tg.start_soon(run, f"stop-{rnd}", prompt_ids[2], SamplingParams(
                        temperature=0, max_tokens=N, ignore_eos=True, stop=[stop]))
                    tg.start_soon(run, f"choice-{rnd}", prompt_ids[3], SamplingParams(
                        temperature=0, max_tokens=N, structured_outputs=StructuredOutputsParams(
                            choice=[choice])))
                    for j in range(3):
                        tg.start_soon(drop, prompt_ids[j] + prompt_ids[3], 2 + 2 * j)
            with anyio.fail_after(10):
                while engine.num_unfinished_requests:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # the last in-flight step completes

    anyio.run(main)
    for rnd in range(2):
        assert results[f"plain0-{rnd}"].outputs[0].token_ids == refs[0][0]
        n2 = results[f"n2-{rnd}"].outputs
        assert len(n2) == 2
        for c in n2:
            assert c.token_ids == refs[1][0]
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
            assert lps == pytest.approx(refs[1][1], abs=1e-4)
        s = results[f"stop-{rnd}"].outputs[0]
        assert (s.text, s.finish_reason) == (stop_expected, "stop")
        assert s.token_ids == refs[2][0][:len(s.token_ids)]
        c = results[f"choice-{rnd}"].outputs[0]
        assert c.text == choice and c.token_ids[:k] == refs[3][0][:k]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert len(dropped) == 6 and all(dropped)  # each abort landed while its step was in flight
    assert engine.num_free_blocks == engine.num_total_blocks
