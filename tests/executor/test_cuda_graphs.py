"""CUDA-graph buckets and padding on the CPU, and a whole engine on the GPU path with
everything CUDA replaced by stand-ins: the CUDA device (fake CUDA), FlashInfer (the stand-in
module) and CUDA graphs (a "graph" whose replay re-runs the captured forward on the static
buffers). Greedy tokens must equal the CPU engine's, with chunked prefill, prefix hits and
preemption, with graphs on and off."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from asyncengine.executor.paths.cuda_graphs import bucket_for, capture_sizes, fill_static
from asyncengine.executor.runtime.simulated_gpu import on_simulated_gpu as gpu_path


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]),
    (3, [1, 2, 3]),
    (4, [1, 2, 4]),
    (8, [1, 2, 4, 8]),
    (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_for_large_batches():
    s256 = capture_sizes(256)
    assert s256[:4] == [1, 2, 4, 8] and s256[-1] == 256 and len(s256) == 3 + 32
    assert all(b - a == 8 for a, b in zip(s256[3:], s256[4:], strict=False))
    s300 = capture_sizes(300)
    assert s300[-4:] == [256, 272, 288, 300]
    s1024 = capture_sizes(1024)
    assert s1024[-1] == 512 and len(s1024) == 35 + 16  # capped: bigger batches run eagerly
    with pytest.raises(ValueError, match="--max-num-seqs"):
        capture_sizes(0)


def test_bucket_choice():
    sizes = capture_sizes(64)
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == \
        [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert bucket_for(sizes, 65) is None  # above the largest bucket: eager
    assert bucket_for(capture_sizes(1024), 513) is None


def test_fill_static_pads_the_tail_of_the_bucket():
    static = torch.full((16,), -1)
    fill_static(static, torch.tensor([5, 6, 7]), 8, pad=0)
    assert static.tolist() == [5, 6, 7, 0, 0, 0, 0, 0] + [-1] * 8  # beyond the bucket: untouched
    fill_static(static, torch.tensor([9, 9, 9, 9]), 4, pad=3)
    assert static[:4].tolist() == [9, 9, 9, 9]
    with pytest.raises(ValueError):
        fill_static(static, torch.arange(5), 4, pad=0)
    with pytest.raises(ValueError):
        fill_static(static, torch.arange(5), 32, pad=0)


# -- the engine on the GPU path, with stand-ins -----------------------------------------------

CONFIG = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 6,
          "num_gpu_blocks_override": 16, "block_size": 8, "max_model_len": 128}
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
           "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "The quick brown fox jumps over the lazy dog. Then the fox"]


async def greedy(engine: AsyncEngine, prompts: list[str],
                 max_tokens: int = 14) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results: dict[int, list[int]] = {}

    async def one(i: int, prompt: str) -> None:
        async for out in engine.generate(prompt, params):
            results[i] = out.outputs[0].token_ids

    async with engine:
        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p)
        first = [results[i] for i in range(len(prompts))]
        results.clear()
        async with anyio.create_task_group() as tg:  # again: prefix-cache hits
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p)
    return first + [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama) -> list[list[int]]:
    return anyio.run(greedy, AsyncEngine(EngineConfig.from_dict({"model": tiny_llama,
                                                                 **CONFIG})), PROMPTS)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_engine_on_the_gpu_path_matches_the_cpu_engine(tiny_llama, cpu_tokens, graphs):
    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, **CONFIG}))
    backend = gpu_path(engine, graphs)
    assert anyio.run(greedy, engine, PROMPTS) == cpu_tokens
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert backend.prefill.num_plans > 0
    if graphs:
        replays = sum(g.replays for g, _ in engine.runner.graphs.graphs.values())
        assert replays > 0 and backend.decode.num_plans == 0
        assert any(b > 1 and g.replays for b, (g, _) in engine.runner.graphs.graphs.items())
    else:
        assert backend.decode.num_plans > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_gemma2_windows_and_soft_caps_on_the_gpu_path(tmp_path):
    """Gemma 2 (a soft cap on every layer, a window of 8 on every other, a scale that is not
    head_dim**-0.5) through FlashInfer's plan parameters (stand-in) and CUDA graphs gives the
    CPU engine's greedy tokens, under chunked prefill, preemption and prefix hits."""
    from tests.utils import make_tiny_model

    path = make_tiny_model(tmp_path / "gemma2", "gemma2", num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"])
    config = {"model": path, **CONFIG, "max_num_seqs": 3, "max_num_batched_tokens": 16,
              "num_gpu_blocks_override": 6, "max_model_len": 64}
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    want = anyio.run(greedy, AsyncEngine(EngineConfig.from_dict(config)), prompts, 8)
    engine = AsyncEngine(EngineConfig.from_dict(config))
    backend = gpu_path(engine, graphs=True)
    assert {o.window for o in backend.variants} == {8, None}  # windowed + global layers
    assert {o.soft_cap for o in backend.variants} == {50.0}
    assert anyio.run(greedy, engine, prompts, 8) == want
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert engine.num_free_blocks == engine.num_total_blocks
