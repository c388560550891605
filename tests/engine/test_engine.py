"""The engine end to end on the CPU: greedy tokens equal transformers', under chunked prefill,
prefix-cache hits and forced preemption; concurrency, aborts and leaks; loop responsiveness."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from tests.utils import embedded_gguf_path, hf_reference_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    " Then the fox",
]


def hf_greedy(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' own generate, one prompt at a time (no padding), with token logprobs."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item()
           for lg, t in zip(out.logits, tokens, strict=True)]
    return tokens, lps


def assert_free(engine: AsyncEngine) -> None:
    assert engine.num_unfinished_requests == 0
    assert engine.num_free_blocks == engine.num_total_blocks


def check_against_hf(llm: LLM, hf, prompts: list[list[int]], n: int) -> None:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                logprobs=1))
    for p, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, p, n)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt {p[:5]}...: {got.token_ids} != {ref_tokens}"
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        # The embedded GGUF runs packed by default: its int4 / int8 kernels round decode
        # activations to ~1.5e-5 of each block's maximum (measured: max |logprob difference|
        # 2.0e-3 over these prompts); float models agree far closer.
        assert lps == pytest.approx(ref_lps, abs=5e-3)
    assert_free(llm.engine)


@pytest.fixture(scope="module")
def embedded_llm():
    return LLM(None, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
               num_gpu_blocks_override=8, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def embedded_hf():
    return hf_reference_model(embedded_gguf_path())


def test_embedded_model_matches_transformers(embedded_llm, embedded_hf):
    """Mixed prompt lengths, chunked prefill (budget 64 tokens), a tiny block pool that forces
    preemption (8 blocks), then the same prompts again as prefix-cache hits."""
    tok = embedded_llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    check_against_hf(embedded_llm, embedded_hf, prompts, 24)
    stats = embedded_llm.engine.stats()
    assert stats.num_preemptions > 0
    check_against_hf(embedded_llm, embedded_hf, prompts[::-1], 24)  # now prefix-cache hits
    assert embedded_llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(family, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
              num_gpu_blocks_override=12, block_size=8, max_model_len=128)
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    check_against_hf(llm, hf, prompts, 16)
    check_against_hf(llm, hf, prompts, 16)  # prefix hits on the second pass
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_prompt_logprobs_match_transformers(embedded_llm, embedded_hf):
    ids = embedded_llm.tokenizer.encode(PROMPTS[1])
    out = embedded_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(embedded_hf(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    # The int4 layers round activations to int8 per block (int4.cpp, as llama.cpp's Q8
    # activations), so a bit of difference upstream (the attention's summation order) can move
    # a logprob by ~1e-3: over PROMPTS, 1.9-3.2e-3 at most, against transformers' float math.
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=4e-3)
        top = ref[pos - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top)


# -- the async engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_config(tiny_llama) -> EngineConfig:
    return EngineConfig.from_dict({"model": tiny_llama, "dtype": "float32", "max_num_seqs": 32,
                                   "max_num_batched_tokens": 256, "block_size": 8,
                                   "num_gpu_blocks_override": 256, "max_model_len": 256})


@pytest.fixture(scope="module")
def engine(engine_config) -> AsyncEngine:
    return AsyncEngine(engine_config)


def mixed_params(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, max_tokens=8, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1),
        SamplingParams(temperature=0.7, n=2, seed=i, max_tokens=6, ignore_eos=True, logprobs=2),
    ]
    return kinds[i % len(kinds)]


def test_64_concurrent_generates_and_aborts(engine):
    async def main():
        async with engine:
            results: dict[int, list] = {}

            async def one(i: int, abort_after: int | None):
                outs = []
                async for out in engine.generate(f"request {i}: tell me about number {i}",
                                                 mixed_params(i), request_id=f"r{i}"):
                    outs.append(out)
                    if abort_after is not None and len(outs) >= abort_after:
                        break  # leaving the iterator aborts the request
                results[i] = outs

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, i, 2 if i % 2 else None)
            for i in range(0, 64, 2):  # the ones that were not aborted finished correctly
                final = results[i][-1]
                sp = mixed_params(i)
                assert final.finished and len(final.outputs) == sp.n
                for c in final.outputs:
                    assert c.finish_reason == "length" and len(c.token_ids) == sp.max_tokens
                    assert c.text == engine.tokenizer.decode(c.token_ids)
                    if sp.logprobs:
                        assert len(c.logprobs) == sp.max_tokens
                        assert all(len(e) >= 1 for e in c.logprobs)
                deltas = [tid for o in results[i] for tid in o.outputs[0].delta_token_ids]
                assert deltas == final.outputs[0].token_ids
            for i in range(1, 64, 2):
                assert not results[i][-1].finished
            await anyio.sleep(0.05)
            assert_free(engine)

    anyio.run(main)


def test_seeded_sampling_same_alone_and_in_busy_batch(engine):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)

    async def alone():
        async with engine:
            return [o async for o in engine.generate("a seeded prompt", sp)][-1]

    async def busy():
        async with engine:
            others = [await engine.add_request(f"noise {i} " * (i + 1),
                                               SamplingParams(temperature=1.0, max_tokens=20,
                                                              ignore_eos=True))
                      for i in range(12)]
            target = [o async for o in engine.generate("a seeded prompt", sp)][-1]
            for s in others:
                async for _ in s:
                    pass
            return target

    a = anyio.run(alone).outputs[0]
    b = anyio.run(busy).outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text


def test_stop_strings_and_token_stops(engine):
    async def main():
        async with engine:
            free = [o async for o in engine.generate(
                "stop test", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))][-1]
            text = free.outputs[0].text
            ids = free.outputs[0].token_ids
            stop = text[5:8]
            if not stop.strip():
                pytest.skip("degenerate text from the random model")
            cut = [o async for o in engine.generate("stop test", SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))][-1].outputs[0]
            assert cut.finish_reason == "stop" and cut.stop_reason == stop
            assert cut.text == text[:text.index(stop)]
            tok = [o async for o in engine.generate("stop test", SamplingParams(
                temperature=0, max_tokens=20, stop_token_ids=[ids[3]]))][-1].outputs[0]
            assert tok.finish_reason == "stop" and tok.token_ids[-1] == ids[3]
            assert tok.token_ids == ids[:ids.index(ids[3]) + 1]
            assert_free(engine)

    anyio.run(main)


def test_bad_input_is_a_clear_error(engine):
    async def main():
        async with engine:
            with pytest.raises(ValueError, match="maximum context length is 256"):
                await engine.add_request([1] * 300, SamplingParams())
            with pytest.raises(ValueError, match="out of vocabulary"):
                await engine.add_request([10**7], SamplingParams())
            with pytest.raises(ValueError, match="empty"):
                await engine.add_request("", SamplingParams())
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)

    anyio.run(main)


def test_loop_stays_responsive_during_long_prefills(engine):
    """A task that sleeps 1 ms keeps ticking while 8 long prefills run."""

    async def main():
        gaps: list[float] = []
        done = anyio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await anyio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            streams = [await engine.add_request([5 + i] * 240, SamplingParams(max_tokens=4))
                       for i in range(8)]
            for s in streams:
                async for _ in s:
                    pass
            done.set()
        gaps.sort()
        return gaps

    gaps = anyio.run(main)
    assert len(gaps) > 20
    # The worst gap is bounded by Python's GIL switch interval plus a little loop work, not by
    # the length of a prefill step.
    assert gaps[-1] < 0.05, f"loop stalled for {gaps[-1] * 1e3:.1f} ms"
    assert gaps[int(len(gaps) * 0.9)] < 0.02


def test_offline_llm_chat(embedded_llm):
    out = embedded_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                            SamplingParams(temperature=0, max_tokens=24))
    answer = out[0].outputs[0]
    assert "Paris" in answer.text
    # The conversation went through the model's chat template, ending in the assistant's turn.
    prompt = embedded_llm.tokenizer.decode(out[0].prompt_token_ids, skip_special_tokens=False)
    assert "What is the capital of France?" in prompt
    assert prompt.rstrip().endswith("assistant")
    # The answer is the assistant's turn alone: it ended on its own or at the limit.
    assert answer.finish_reason in ("stop", "length") and 0 < len(answer.token_ids) <= 24
    assert "<|im_start|>" not in answer.text


def test_a_failing_step_fails_requests_instead_of_hanging(tiny_llama, monkeypatch):
    """A device failure ends every request with EngineDeadError, new ones are refused, and the
    server's /health says 503."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.engine.errors import EngineDeadError
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, "dtype": "float32",
                                                 "num_gpu_blocks_override": 64}))

    def broken(inputs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "execute", broken)

    async def main():
        async with engine:
            with anyio.fail_after(30):
                with pytest.raises(EngineDeadError, match="device fell over"):
                    async for _ in engine.generate("hello", SamplingParams(max_tokens=4)):
                        pass
                with pytest.raises(EngineDeadError):
                    await engine.add_request("again", SamplingParams())
            async with TestClient(TestServer(build_app(engine, None, ServerSettings()))) as c:
                r = await c.get("/health")
                return r.status, await r.json()

    status, body = anyio.run(main)
    assert status == 503 and "device fell over" in body["error"]["message"]


def test_a_refused_request_holds_nothing(tiny_llama):
    """n samples that cannot all fit the block pool are refused together, leaving no trace."""
    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, "dtype": "float32",
                                                 "num_gpu_blocks_override": 4, "block_size": 8,
                                                 "max_model_len": 256}))

    async def main():
        async with engine:
            with pytest.raises(ValueError, match="block"):
                await engine.add_request([7] * 20, SamplingParams(n=2, max_tokens=40))
            out = [o async for o in engine.generate([7] * 5, SamplingParams(max_tokens=3))][-1]
            assert out.finished
            assert_free(engine)

    anyio.run(main)


def test_the_loop_does_not_spin_when_idle(engine, monkeypatch):
    calls = []
    real = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: calls.append(1) or real())

    async def main():
        async with engine:
            [o async for o in engine.generate("wake up", SamplingParams(max_tokens=3))]
            busy = len(calls)
            await anyio.sleep(0.3)
            return busy, len(calls)

    busy, after = anyio.run(main)
    assert busy >= 3 and after == busy


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_BATCH"), reason="Linux only")
def test_on_the_cpu_the_loop_thread_does_not_preempt_the_compute_on_wakeup(engine):
    """The loop's thread runs as SCHED_BATCH inside ``async with`` (thread_policy.py), the
    device's worker as SCHED_OTHER, and the loop's policy is restored afterwards."""
    import os
    import threading

    policies = {}

    def record(inputs, real=engine.runner.execute):
        policies["worker"] = os.sched_getscheduler(0)
        return real(inputs)

    before = os.sched_getscheduler(0)

    async def main():
        engine.runner.execute = record
        try:
            async with engine:
                policies["loop"] = os.sched_getscheduler(0)
                policies["loop_thread"] = threading.get_ident()
                [o async for o in engine.generate("wake up", SamplingParams(max_tokens=2))]
        finally:
            del engine.runner.execute

    anyio.run(main)
    assert before == os.SCHED_OTHER
    assert policies["loop"] == os.SCHED_BATCH and policies["worker"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == before


def test_offline_llm_builds_one_output_per_request(tiny_llama, monkeypatch):
    """LLM.generate asks for final outputs only (vLLM's FINAL_ONLY): each request's consumer is
    woken and given an output once, at its end, not after every step; the outputs are the
    ones iterating the streams gives (n > 1, logprobs, stop strings and penalties too)."""
    from asyncengine.engine.streams import RequestStream

    prompts = [f"offline {i} " * (i + 1) for i in range(6)]
    params = [mixed_params(i) for i in range(6)]
    config = {"dtype": "float32", "max_num_seqs": 8, "block_size": 8, "max_model_len": 256}
    engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, **config}))

    async def iterate() -> list:
        async with engine:
            streams = [await engine.add_request(p, sp)
                       for p, sp in zip(prompts, params, strict=True)]
            finals = []
            for stream in streams:
                async for out in stream:
                    last = out
                finals.append(last)
            return finals

    iterated = anyio.run(iterate)
    takes: list[str] = []
    real_take = RequestStream._take
    monkeypatch.setattr(RequestStream, "_take",
                        lambda self: takes.append(self.request_id) or real_take(self))
    llm = LLM(tiny_llama, **config)
    outs = llm.generate(prompts, params)
    assert len(takes) == len(set(takes)) == len(prompts)  # one output built per request
    assert all(o.finished for o in outs)
    for sp, got, want in zip(params, outs, iterated, strict=True):
        exact = sp.temperature == 0 or sp.seed is not None  # the same tokens in any batch
        fields = (("token_ids", "text", "finish_reason") if exact
                  else ("finish_reason",))
        for name in fields:
            assert [getattr(c, name) for c in got.outputs] == \
                [getattr(c, name) for c in want.outputs], name
        assert [len(c.token_ids) for c in got.outputs] == [len(c.token_ids)
                                                          for c in want.outputs]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
