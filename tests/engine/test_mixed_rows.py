"""A row that needs Python, in a step of fast rows, gives what it gives alone.

Most rows of a big decode step take the array path (``executor/step/step_rows.py``: past
``FEW_ROWS`` requests, the continuing rows follow from the last step's with numpy). A request
with a feature of its own joins such a batch of plain greedy decodes and runs among them:
stop strings and stop tokens, min_tokens, a grammar, a thinking budget before a grammar,
logprobs and prompt logprobs, n > 1 with a seed, penalties, a prefix hit, an abort, a
preemption, drafts, a LoRA adapter. Each request's tokens (and logprobs) equal the same
request's run alone, the plain rows' too, the big steps really took the array path, and the
pool is free after.
"""

from __future__ import annotations

import anyio
import pytest

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import StructuredOutputsParams
from asyncengine.engine.engine import AsyncEngine
from asyncengine.executor import runner as runner_module
from asyncengine.executor.step import step_rows
from tests.spec_utils import NGRAM, pool_is_free

NUM_FAST = 20  # plain rows: with the special ones, every big step is past FEW_ROWS
FAST_TOKENS = 20
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
GREEDY = SamplingParams(temperature=0, max_tokens=FAST_TOKENS, ignore_eos=True)
WORDS = ["red", "blue", "green", "the", "a", "one", "two", "cat", "dog", "sun", "sea", "sky"]


def fast_prompts() -> list[str]:
    return [f"{WORDS[i % 12]} {WORDS[(i * 5 + 1) % 12]} {WORDS[(i * 7 + 3) % 12]} {i}, "
            f"and so on" for i in range(NUM_FAST)]


def make_engine(model: str, **overrides) -> AsyncEngine:
    values = {"model": model, "dtype": "float32", "max_num_seqs": 48,
              "max_num_batched_tokens": 512, "block_size": 8, "num_gpu_blocks_override": 400,
              "max_model_len": 128, **overrides}
    return AsyncEngine(EngineConfig.from_dict(values))


class ArraySteps:
    """Counts the steps whose rows the array path gathered (past FEW_ROWS, no drafts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.array = 0
        real = runner_module.gather_rows

        def counted(prev, out, *args, **kwargs):
            n = len(out.scheduled)
            if prev is not None and n > step_rows.FEW_ROWS and not any(
                    s.spec_token_ids for s in out.scheduled):
                self.array += 1
            return real(prev, out, *args, **kwargs)

        monkeypatch.setattr(runner_module, "gather_rows", counted)


def summary(out) -> tuple[list, list]:
    """What a user reads of a request's outputs: each sample's tokens, text and why it ended
    (compared exactly), and the logprobs' token ids and values (the values within float
    rounding: a row's matmuls are not bit-equal in batches of different sizes)."""
    exact, logprobs = [], []

    def table(positions):
        if positions is None:
            return None, None
        ids = [None if pos is None else sorted(pos) for pos in positions]
        values = [None if pos is None else [pos[t].logprob for t in sorted(pos)]
                  for pos in positions]
        return ids, values

    for c in out.outputs:
        ids, values = table(c.logprobs)
        exact.append((list(c.token_ids), c.text, c.finish_reason, ids))
        logprobs.append(values)
    ids, values = table(out.prompt_logprobs)
    exact.append(ids)
    logprobs.append(values)
    return exact, logprobs


def flat(values) -> list[float]:
    if values is None:
        return []
    if isinstance(values, float):
        return [values]
    return [x for v in values for x in flat(v)]


async def run_alone(engine: AsyncEngine, jobs: list[dict]) -> list:
    """Each job's final output, one request at a time."""
    results = []
    for job in jobs:
        final = None
        async for out in engine.generate(job["prompt"], job["params"],
                                         lora_name=job.get("lora")):
            final = out
            if job.get("abort_after") and len(out.outputs[0].token_ids) >= job["abort_after"]:
                break
        results.append(final)
    return results


async def run_among_fast(engine: AsyncEngine, fast: list[dict], special: list[dict]) -> list:
    """The fast rows start first; once they decode, the special jobs join them."""
    results: list = [None] * (len(fast) + len(special))
    decoding = anyio.Event()

    async def one(i: int, job: dict) -> None:
        async for out in engine.generate(job["prompt"], job["params"],
                                         lora_name=job.get("lora")):
            results[i] = out
            if i == 0 and len(out.outputs[0].token_ids) >= 3:
                decoding.set()
            if job.get("abort_after") and len(out.outputs[0].token_ids) >= job["abort_after"]:
                break  # leaving the stream aborts the request

    async with anyio.create_task_group() as tg:
        for i, job in enumerate(fast):
            tg.start_soon(one, i, job)
        await decoding.wait()
        for j, job in enumerate(special):
            tg.start_soon(one, len(fast) + j, job)
    return results


async def settled(engine: AsyncEngine) -> bool:
    """The pool is free once an abort (a stream left early) has been carried out."""
    with anyio.move_on_after(5):
        while not pool_is_free(engine):
            await anyio.sleep(0.005)
    return pool_is_free(engine)


async def references(engine: AsyncEngine, fast: list[dict], special: list[dict]) -> list:
    """The fast rows by themselves (a batch of them alone), then each special job alone."""
    alone = await run_among_fast(engine, fast, [])
    alone += await run_alone(engine, special)
    assert await settled(engine)
    return alone


def compare(alone: list, mixed: list, fast: list[dict], special: list[dict],
            array: ArraySteps) -> None:
    assert array.array >= FAST_TOKENS // 2, "the big steps did not take the array path"
    for i, (a, m) in enumerate(zip(alone, mixed, strict=True)):
        name = "fast" if i < len(fast) else special[i - len(fast)]["name"]
        (ea, la), (em, lm) = summary(a), summary(m)
        assert ea == em, (i, name)
        assert flat(lm) == pytest.approx(flat(la), abs=1e-3), (i, name)


def check(engine_alone: AsyncEngine, engine_mixed: AsyncEngine, fast: list[dict],
          special: list[dict], array: ArraySteps) -> tuple[list, list]:
    """The jobs alone on ``engine_alone``, then among the fast rows on ``engine_mixed`` (the
    same engine or another; a cold prefix cache either way)."""
    async def main():
        async with engine_alone:
            alone = await references(engine_alone, fast, special)
            engine_alone.scheduler.reset_prefix_cache()
        array.array = 0  # (the fast rows' batch alone took it too)
        async with engine_mixed:
            mixed = await run_among_fast(engine_mixed, fast, special)
            assert await settled(engine_mixed)
        return alone, mixed

    alone, mixed = anyio.run(main)
    compare(alone, mixed, fast, special, array)
    return alone, mixed


@pytest.fixture(scope="module")
def plain(tiny_llama) -> AsyncEngine:
    """One engine for the references and the features' mixed run (engines take seconds to
    build, mostly the tokenizer)."""
    return make_engine(tiny_llama)


def specials(tok, ref, prompt: str) -> list[dict]:
    """One job per feature; stop strings and tokens taken from ``ref``, the prompt's greedy
    output, so that they are met."""
    ref_ids = ref.outputs[0].token_ids
    stop_text = tok.decode(ref_ids[8:10]).strip() or tok.decode(ref_ids[8:11])
    end_tag = tok.encode(" done", add_special_tokens=False)
    return [
        {"name": "stop string", "prompt": prompt,
         "params": SamplingParams(temperature=0, max_tokens=30, stop=[stop_text])},
        {"name": "stop token", "prompt": prompt,
         "params": SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ref_ids[6]])},
        {"name": "min_tokens", "prompt": prompt,
         "params": SamplingParams(temperature=0, max_tokens=30, min_tokens=12,
                                  stop_token_ids=[ref_ids[4]])},
        {"name": "grammar", "prompt": "JSON: ",
         "params": SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
             StructuredOutputsParams(json=SCHEMA)))},
        {"name": "thinking budget", "prompt": "Think: ",
         "params": SamplingParams(temperature=0, max_tokens=30, thinking_token_budget=5,
                                  reasoning_end_token_ids=end_tag, structured_outputs=(
                                      StructuredOutputsParams(json=SCHEMA)))},
        {"name": "logprobs", "prompt": "one two three four",
         "params": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3,
                                  prompt_logprobs=2)},
        {"name": "n=2 seeded", "prompt": "sea sky sun",
         "params": SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=16,
                                  ignore_eos=True)},
        {"name": "penalties", "prompt": "cat dog cat dog cat",
         "params": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                  repetition_penalty=1.4, frequency_penalty=0.5,
                                  presence_penalty=0.3)},
        {"name": "prefix hit", "prompt": prompt + " and on and on, and more of it",
         "params": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)},
        {"name": "abort", "prompt": "two one sea", "abort_after": 5,
         "params": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)},
    ]


def test_each_feature_s_row_among_fast_rows_gives_what_it_gives_alone(plain, monkeypatch):
    fast = [{"prompt": p, "params": GREEDY} for p in fast_prompts()]
    array = ArraySteps(monkeypatch)
    engine = plain

    async def main():
        async with engine:
            (ref,) = await run_alone(engine, fast[:1])
            special = specials(engine.tokenizer, ref, fast[0]["prompt"])
            alone = await references(engine, fast, special)
            engine.scheduler.reset_prefix_cache()
            hits = engine.scheduler.make_stats().prefix_cache_hits
            array.array = 0  # (the fast rows' batch alone took it too)
            mixed = await run_among_fast(engine, fast, special)
            assert await settled(engine)
            assert engine.scheduler.make_stats().prefix_cache_hits > hits
        return special, alone, mixed

    special, alone, mixed = anyio.run(main)
    compare(alone, mixed, fast, special, array)
    by_name = {s["name"]: mixed[len(fast) + i] for i, s in enumerate(special)}
    # The features did what they are for (else the equality above proves little).
    assert by_name["stop string"].outputs[0].finish_reason == "stop"
    assert by_name["stop token"].outputs[0].finish_reason == "stop"
    assert len(by_name["min_tokens"].outputs[0].token_ids) >= 12
    assert len(by_name["abort"].outputs[0].token_ids) < 40
    assert len(by_name["n=2 seeded"].outputs) == 2
    assert by_name["logprobs"].prompt_logprobs is not None


def test_preemption_and_drafts_among_fast_rows(plain, tiny_llama, monkeypatch):
    """A pool too small for every row preempts some of them (the array path sees
    ``preempted_req_ids``); an n-gram drafting engine mixes draft steps, gathered request
    by request, with array steps. Both give the tokens of the plain engine's runs alone."""
    fast = [{"prompt": p, "params": GREEDY} for p in fast_prompts()]
    repeat = "1 2 3 1 2 3 1 2 3 1 2"
    special = [{"name": "drafts", "prompt": repeat,
                "params": SamplingParams(temperature=0, max_tokens=FAST_TOKENS,
                                         ignore_eos=True)}]
    array = ArraySteps(monkeypatch)
    small = make_engine(tiny_llama, num_gpu_blocks_override=60)
    check(plain, small, fast, special, array)
    assert small.scheduler.make_stats().num_preemptions > 0
    spec = make_engine(tiny_llama, speculative_config=NGRAM)
    check(plain, spec, fast, special, array)


def test_a_lora_row_among_fast_rows(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from tests.engine.test_lora import ADAPTERS, make_adapter
    from tests.utils import make_tiny_model

    base = make_tiny_model(tmp_path / "llama", "llama")
    adapter = make_adapter(base, tmp_path / "qv4", *ADAPTERS["qv4"], seed=10)

    def engine() -> AsyncEngine:
        return make_engine(base, enable_lora=True, lora_modules=[f"qv4={adapter}"],
                           max_lora_rank=8)

    fast = [{"prompt": p, "params": GREEDY} for p in fast_prompts()]
    special = [{"name": "lora", "prompt": fast[3]["prompt"], "lora": "qv4",
                "params": GREEDY}]
    lora = engine()
    alone, _ = check(lora, lora, fast, special, ArraySteps(monkeypatch))
    assert alone[-1].outputs[0].token_ids != alone[3].outputs[0].token_ids  # it adapts
