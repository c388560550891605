"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``) on ``AsyncEngine.generate``:
cumulative outputs (the default), the deltas (which add up to the cumulative text and tokens),
or the final output alone."""

from __future__ import annotations

import anyio

from asyncengine import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams


def test_cumulative_delta_and_final_only(tiny_llama):
    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, "dtype": "float32"}))
    prompt = [5, 17, 300, 42]

    async def run(kind: RequestOutputKind) -> list:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate(prompt, params)]

    async def main() -> dict:
        async with engine:
            return {kind: await run(kind) for kind in RequestOutputKind}

    outs = anyio.run(main)
    cumulative = outs[RequestOutputKind.CUMULATIVE]
    final = cumulative[-1].outputs[0]
    assert final.num_output_tokens == 12 and len(cumulative) > 1
    deltas = outs[RequestOutputKind.DELTA]
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.token_ids
    assert deltas[-1].finished and not deltas[0].finished
    (only,) = outs[RequestOutputKind.FINAL_ONLY]
    assert only.finished and only.outputs[0].token_ids == final.token_ids
    assert only.outputs[0].text == final.text
    assert engine.num_free_blocks == engine.num_total_blocks
