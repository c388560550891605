"""The priority scheduler on the real engine: with the block pool nearly full, urgent requests
submitted later finish before less urgent ones submitted earlier, and none is lost."""

from __future__ import annotations

import anyio

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine


def test_urgent_requests_overtake_under_a_full_pool(tiny_llama):
    engine = AsyncEngine(EngineConfig.from_dict({
        "model": tiny_llama, "dtype": "float32", "scheduler": "priority", "block_size": 8,
        "num_gpu_blocks_override": 16, "max_num_seqs": 4, "max_model_len": 128}))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    finished: list[str] = []

    async def run(stream, name):
        async for out in stream:
            last = out
        assert last.finished and len(last.outputs[0].token_ids) == 30
        finished.append(name)

    async def main():
        async with engine, anyio.create_task_group() as tg:
            lows = [await engine.add_request([11 + i] * 20, params, priority=10)
                    for i in range(6)]
            for i, s in enumerate(lows):
                tg.start_soon(run, s, f"low{i}")
            while engine.stats().num_running < 2:  # the pool holds two of them at a time
                await anyio.sleep(0.005)
            done_before = set(finished)
            for i in range(3):
                tg.start_soon(run, await engine.add_request([51 + i] * 20, params, priority=0),
                              f"high{i}")
        return done_before

    done_before = anyio.run(main)
    assert len(finished) == 9  # nothing lost
    last_high = max(finished.index(f"high{i}") for i in range(3))
    pending_lows = [n for n in finished if n.startswith("low") and n not in done_before]
    assert pending_lows and all(finished.index(n) > last_high for n in pending_lows), finished
    assert engine.stats().num_preemptions > 0
    assert engine.num_free_blocks == engine.num_total_blocks
