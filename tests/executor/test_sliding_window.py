"""A model whose every layer has a sliding window holds only the blocks its window needs: the
blocks wholly before every running request's window go back to the pool (and are reused by
others) while the request runs, its tokens still equal transformers', and the pool is whole
again after. A request longer than the whole KV cache then fits. A prefix hit needs only the
blocks its window reaches, as in vLLM, so a prompt whose leading blocks were reused still
hits."""

from __future__ import annotations

import anyio
import pytest

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.core.kv.hashing import update_block_hashes
from asyncengine.core.kv.manager import KVCacheManager
from asyncengine.core.request import Request
from asyncengine.engine.engine import AsyncEngine
from tests.engine.test_engine import hf_greedy
from tests.utils import hf_reference_model, make_tiny_model

WINDOW, BLOCK, CHUNK = 8, 4, 8


@pytest.fixture(scope="module")
def mistral_sw(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("sw") / "m", "mistral_sw",
                           initializer_range=0.1)


def test_blocks_before_the_window_are_released_and_tokens_stay_exact(mistral_sw):
    n = 40
    prompts = [list(range(300, 330)), list(range(1000, 1024))]
    hf = hf_reference_model(mistral_sw)
    refs = [hf_greedy(hf, ids, n)[0] for ids in prompts]
    # 14 blocks of 4 = 56 tokens: less than one request's 30 + 40 without the release.
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": mistral_sw, "dtype": "float32", "max_num_seqs": 2, "block_size": BLOCK,
        "max_num_batched_tokens": CHUNK, "num_gpu_blocks_override": 14,
        "max_model_len": 128}))
    assert engine.num_total_blocks * BLOCK < len(prompts[0]) + n
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    results: dict[int, list[int]] = {}
    held: list[int] = []

    async def run(i: int) -> None:
        async for out in engine.generate(prompts[i], greedy):
            results[i] = out.outputs[0].token_ids
            held.append(engine.num_total_blocks - engine.num_free_blocks)

    async def main() -> None:
        async with engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)

    anyio.run(main)
    assert results == dict(enumerate(refs))
    # Two requests, each within its window, the step's chunk and a block on either side.
    assert max(held) <= 2 * ((WINDOW + CHUNK) // BLOCK + 2)
    assert held[-1] <= WINDOW // BLOCK + 2  # the last one decoding alone
    assert engine.stats().num_preemptions == 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_release_is_per_step_work_and_free_after(monkeypatch):
    """The manager releases each block once, as the window passes it (touching only those
    blocks), never frees one twice, and holds nothing after ``free``."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True,
                        sliding_window=WINDOW)
    req = Request("r", list(range(60)), SamplingParams(max_tokens=1), eos_token_ids=set())
    freed: list[int] = []
    real_free = kv.pool.free

    def spy(blocks):
        blocks = list(blocks)
        freed.extend(b.block_id for b in blocks)
        real_free(blocks)

    monkeypatch.setattr(kv.pool, "free", spy)
    computed = 0
    while computed < 60:
        step = min(CHUNK, 60 - computed)
        assert kv.allocate_slots(req, step)
        req.num_computed_tokens = computed = computed + step
        kv.cache_full_blocks(req, computed)
        assert len(freed) == max(0, (computed - WINDOW + 1) // BLOCK)  # released so far
        in_use = kv.num_total_blocks - kv.num_free_blocks
        assert in_use <= (WINDOW + CHUNK) // BLOCK + 2
    kv.free(req)
    assert len(freed) == len(set(freed)) == 15  # every block once
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.parametrize("blocks, preempted", [(12, False), (6, True)])
def test_the_gpu_tests_settings_on_an_all_window_model(mistral_sw, blocks, preempted):
    """tests/gpu/test_gpu.py's stress settings (prompts, chunk, pool) on a model windowed in every
    layer, with the counts the first GPU run found: in 12 blocks nothing is preempted (each
    request holds only its window's blocks) and, in any pool, nothing hits the prefix cache
    (a prompt's only full block before its last token, which the window of a hit needs, is
    released and reused before the second pass); in 6 blocks requests are preempted and the
    tokens stay transformers'."""
    from asyncengine import LLM
    from tests.gpu.test_gpu import PROMPTS, STRESS

    llm = LLM(mistral_sw, dtype="float32", num_gpu_blocks_override=blocks, **STRESS)
    hf = hf_reference_model(mistral_sw)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 32)[0]
                                                          for p in prompts]
    stats = llm.engine.stats()
    assert (stats.num_preemptions > 0) == preempted
    assert stats.prefix_cache_queries > 0 and stats.prefix_cache_hits == 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def _compute(kv: KVCacheManager, req: Request, upto: int) -> None:
    """Allocate and compute ``req`` up to ``upto`` tokens in chunks, as steps would."""
    while req.num_computed_tokens < upto:
        step = min(CHUNK, upto - req.num_computed_tokens)
        assert kv.allocate_slots(req, step)
        req.num_computed_tokens += step
        kv.cache_full_blocks(req, req.num_computed_tokens)


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches():
    """As vLLM's sliding-window manager: once a request's leading blocks were released and
    reused, the same prompt still hits every block up to where its window's blocks are
    cached; the blocks before stand in (placeholders), are never freed, and the pool is whole
    after."""
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True,
                        sliding_window=WINDOW)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks before the last token's
    first = Request("a", prompt, SamplingParams(max_tokens=1), eos_token_ids=set())
    assert kv.get_computed_blocks(first) == ([], 0)
    _compute(kv, first, 30)
    kv.free(first)
    # The LRU's front: a's unhashed last block, the 4 never used, then a's blocks in the
    # order they were released (leading first). Another request takes 6: a's block 0 too.
    other = Request("b", list(range(500, 540)), SamplingParams(max_tokens=1),
                    eos_token_ids=set())
    assert kv.allocate_slots(other, 6 * BLOCK)
    again = Request("a2", prompt, SamplingParams(max_tokens=1), eos_token_ids=set())
    hashes = update_block_hashes(again, BLOCK)
    assert kv.pool.get_cached_block(hashes[0]) is None  # the chain from block 0 is broken
    assert all(kv.pool.get_cached_block(h) is not None for h in hashes[1:7])
    blocks, hit = kv.get_computed_blocks(again)
    assert hit == 28 and len(blocks) == 7  # (30 - 1) // 4 blocks: all of them
    # The window of position 28 reaches back to key 21: blocks 5 and 6 are real.
    real = [b for b in blocks if kv.pool.blocks[b.block_id] is b]
    assert real == blocks[5:] and all(b.block_id == blocks[5].block_id for b in blocks[:5])
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(again, 2, blocks)
    # The 2 real hits (evictable until now) and one new block for tokens 28-29: no
    # placeholder is taken from the pool.
    assert kv.num_free_blocks == free_before - 3
    again.num_computed_tokens = 28
    _compute(kv, again, 30)
    assert kv.get_block_ids("a2")[:5] == [blocks[5].block_id] * 5
    kv.free(again)
    kv.free(other)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_windowed_prefix_hit_keeps_the_tokens_exact(mistral_sw):
    """The same long prompt after its leading blocks were reused: the hit covers most of it,
    and the tokens equal transformers' (the placeholders' rows are masked by the window)."""
    n = 12
    prompt = list(range(300, 340))
    hf = hf_reference_model(mistral_sw)
    ref = hf_greedy(hf, prompt, n)[0]
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": mistral_sw, "dtype": "float32", "max_num_seqs": 2, "block_size": BLOCK,
        "max_num_batched_tokens": CHUNK, "num_gpu_blocks_override": 10,
        "max_model_len": 128}))
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    async def run(ids: list[int], params: SamplingParams = greedy) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(ids, params):
            tokens = out.outputs[0].token_ids
        return tokens

    async def main() -> list[list[int]]:
        async with engine:
            first = await run(prompt)
            # 3 blocks from the front of the LRU: the first request's leading blocks.
            await run(list(range(1000, 1010)), SamplingParams(max_tokens=2, ignore_eos=True))
            hits_before = engine.stats().prefix_cache_hits
            again = await run(prompt)
            return [first, again, [engine.stats().prefix_cache_hits - hits_before]]

    first, again, (hit,) = anyio.run(main)
    assert first == again == ref
    assert hit >= 32  # most of the 40-token prompt, though its chain from block 0 is gone
    assert engine.num_free_blocks == engine.num_total_blocks
