"""AsyncEngine.embed in-process: last-token and mean pooling equal transformers' hidden states,
and embedding while requests generate changes neither the vectors nor the generations."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from asyncengine.core.sampling_params import SamplingParams
from tests.utils import hf_reference_model


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from asyncengine.engine.llm import LLM

    # A small token budget: several prompts are split across device submissions.
    return LLM(tiny_llama, num_gpu_blocks_override=64, max_num_batched_tokens=64,
               max_num_seqs=4)


def reference(tiny_llama: str, prompts: list[list[int]], pooling: str) -> np.ndarray:
    model = hf_reference_model(tiny_llama)
    out = []
    with torch.no_grad():
        for p in prompts:
            hidden = model.model(torch.tensor([p])).last_hidden_state[0]
            vec = hidden[-1] if pooling == "last" else hidden.mean(0)
            out.append(torch.nn.functional.normalize(vec, dim=0).numpy())
    return np.stack(out)


def test_pooling_matches_transformers(llm, tiny_llama):
    prompts = [list(range(100, 100 + n)) for n in (3, 40, 17, 50)]

    async def run(pooling: str) -> np.ndarray:
        async with llm.engine:
            return await llm.engine.embed(prompts, pooling=pooling)

    for pooling in ("last", "mean"):
        got = anyio.run(run, pooling)
        assert got.shape == (4, 64) and got.dtype == np.float32
        assert np.abs(got - reference(tiny_llama, prompts, pooling)).max() < 1e-4, pooling


def test_embedding_between_steps_leaves_generation_alone(llm):
    prompt = [5, 6, 7, 8, 9] * 4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt, params)[0].outputs[0].token_ids

    async def run():
        async with llm.engine:
            stream = await llm.engine.add_request(prompt, params.clone())
            vectors = []
            async for out in stream:
                if len(vectors) < 3:  # between the steps of the running request
                    vectors.append(await llm.engine.embed([prompt]))
                final = out
            return final.outputs[0].token_ids, vectors

    together, vectors = anyio.run(run)
    assert together == alone
    assert all(np.array_equal(v, vectors[0]) for v in vectors)


def test_too_long_or_empty_inputs_are_value_errors(llm):
    async def run(prompts):
        async with llm.engine:
            try:
                await llm.engine.embed(prompts)
            except ValueError as e:
                return str(e)

    assert "maximum context length is 4096" in anyio.run(run, [[1] * 4097])
    assert "empty" in anyio.run(run, [[1], []])
