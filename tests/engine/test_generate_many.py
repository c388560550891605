"""``AsyncEngine.generate_many``: many requests read by one consumer, woken once per step.

Each request gets exactly what its own ``generate()`` would give (greedy tokens and text, in
every output kind); the consumer is woken at most once per step; a request that fails ends
alone; leaving early aborts the rest and frees every block."""

from __future__ import annotations

import anyio
import pytest

from asyncengine import AsyncEngine, EngineConfig, RequestOutputKind, SamplingParams
from asyncengine.engine.errors import EngineDeadError, RequestFailed

PROMPTS = [[5, 17, 300, 42], [7, 8, 9], [100, 200, 300, 400, 500, 600], [11], [42, 42]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return AsyncEngine(EngineConfig.from_dict({
        "model": tiny_llama, "dtype": "float32", "block_size": 8,
        "num_gpu_blocks_override": 64}))


def _params(kind: RequestOutputKind, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=kind)


def test_each_request_gets_what_generate_gives_it(engine):
    async def main():
        async with engine:
            alone = []
            for p in PROMPTS:
                outs = [o async for o in engine.generate(p, _params(RequestOutputKind.CUMULATIVE))]
                alone.append(outs[-1].outputs[0])
            got = {}
            for kind in RequestOutputKind:
                items = []
                steps = engine.loop.num_steps
                async for outputs in engine.generate_many(PROMPTS, _params(kind),
                                                          request_id="many"):
                    assert outputs  # never woken for nothing
                    items.append(outputs)
                got[kind] = items, engine.loop.num_steps - steps
            return alone, got

    alone, got = anyio.run(main)
    ids = [f"many-{i}" for i in range(len(PROMPTS))]
    for kind, (items, steps) in got.items():
        assert len(items) <= steps  # one wake-up per step at most, for all five requests
        outs = [o for outputs in items for o in outputs]
        per_request = {rid: [o for o in outs if o.request_id == rid] for rid in ids}
        for rid, want in zip(ids, alone, strict=True):
            mine = per_request[rid]
            assert mine[-1].finished and sum(o.finished for o in mine) == 1
            if kind == RequestOutputKind.DELTA:
                assert [t for o in mine for t in o.outputs[0].token_ids] == want.token_ids
                assert "".join(o.outputs[0].text for o in mine) == want.text
            else:
                assert mine[-1].outputs[0].token_ids == want.token_ids
                assert mine[-1].outputs[0].text == want.text
            if kind == RequestOutputKind.FINAL_ONLY:
                assert len(mine) == 1
    assert len(got[RequestOutputKind.FINAL_ONLY][0]) <= len(PROMPTS)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_lone_prompt_is_named_like_the_others(engine):
    async def main():
        async with engine:
            return [o.request_id async for outputs in engine.generate_many(
                [[5, 6, 7]], _params(RequestOutputKind.FINAL_ONLY, 3), request_id="one")
                for o in outputs]

    assert anyio.run(main) == ["one-0"]


def test_leaving_early_aborts_every_request_and_frees_the_blocks(engine):
    async def main():
        async with engine:
            seen = 0
            async for outputs in engine.generate_many(
                    PROMPTS, _params(RequestOutputKind.DELTA, 200)):
                seen += len(outputs)
                if seen >= 2 * len(PROMPTS):
                    break
            for _ in range(100):  # the aborts are immediate for running requests
                if not engine.num_unfinished_requests:
                    break
                await anyio.sleep(0.01)
            return engine.num_unfinished_requests

    assert anyio.run(main) == 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_failing_request_ends_alone(engine, monkeypatch):
    """The detokenizer of one request raises: that request ends with "error" and its error in
    ``errors``; the others end with every token."""
    from asyncengine.engine.output_processor import OutputProcessor

    real = OutputProcessor._emit_one

    def emit_one(self, stream, req, now, result):
        if req.request_id == "f-2" and len(req.output_token_ids) >= 3:
            raise RuntimeError("boom")
        return real(self, stream, req, now, result)

    monkeypatch.setattr(OutputProcessor, "_emit_one", emit_one)

    async def main():
        async with engine:
            finals = {}
            many = engine.generate_many(PROMPTS, _params(RequestOutputKind.DELTA, 12),
                                        request_id="f")
            async for outputs in many:
                for o in outputs:
                    if o.finished:
                        finals[o.request_id] = o
            return finals, many

    finals, _ = anyio.run(main)
    assert set(finals) == {f"f-{i}" for i in range(len(PROMPTS))}
    assert finals["f-2"].outputs[0].finish_reason == "error"
    for rid, o in finals.items():
        if rid != "f-2":
            assert o.outputs[0].finish_reason == "length"
            assert o.outputs[0].num_output_tokens == 12
    assert engine.num_free_blocks == engine.num_total_blocks


def test_the_group_records_errors_and_raises_only_the_engines_death(engine):
    from asyncengine.core.request import Request
    from asyncengine.engine.stream_group import StreamGroup
    from asyncengine.engine.streams import RequestStream

    def make_stream(rid: str) -> RequestStream:
        params = SamplingParams(max_tokens=4)
        sample = engine.outputs.make_sample(Request(rid, [1, 2, 3], params), params)
        return RequestStream(rid, None, [1, 2, 3], [sample], on_abort=lambda _: None)

    a, b = make_stream("a"), make_stream("b")
    group = StreamGroup([a, b])
    for s in a.samples:
        s.finish_reason = "error"
    a.fail(RequestFailed("its grammar failed"))

    async def first():
        return await group.__anext__()

    (out,) = anyio.run(first)
    assert out.request_id == "a" and out.finished
    assert isinstance(group.errors["a"], RequestFailed) and list(group.streams) == ["b"]
    b.fail(EngineDeadError("the device is gone"))
    with pytest.raises(EngineDeadError):
        anyio.run(first)


def test_n_samples_and_seeds_come_out_as_generate_gives_them(engine):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def main():
        async with engine:
            alone = [o async for o in engine.generate(PROMPTS[0], params.clone())][-1]
            many = [o async for outputs in engine.generate_many(PROMPTS[:2], params)
                    for o in outputs]
            return alone, many

    alone, many = anyio.run(main)
    first = next(o for o in many if o.request_id.endswith("-0"))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in alone.outputs]
    assert len(many) == 2 and all(len(o.outputs) == 2 and o.finished for o in many)
