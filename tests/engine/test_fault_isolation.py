"""One request's fault ends that request alone: a structured-output plugin whose grammar
raises mid-stream fails its own request with a clear error, while 8 concurrent requests
finish with exactly the tokens of a clean run, and every block comes back."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncengine import SamplingParams, StructuredOutputsParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine
from asyncengine.engine.errors import RequestFailed
from asyncengine.ext.registry import new_plugin_manager
from asyncengine.plugins import hookimpl

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,",
           "Once upon a time", "The quick brown fox", "import numpy as np",
           "Dear Sir or Madam,", "In 1492, Columbus"]


class BoomGrammar:
    """Allows every token, and raises on its fourth token."""

    def __init__(self) -> None:
        self.accepted = 0

    def accept_token(self, token_id: int) -> bool:
        self.accepted += 1
        if self.accepted == 4:
            raise RuntimeError("the test grammar exploded")
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens

    def reset(self) -> None:
        self.accepted = 0

    def fresh(self) -> BoomGrammar:
        return BoomGrammar()


class BoomBackend:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def compile_grammar(self, kind: str, spec) -> BoomGrammar:
        return BoomGrammar()

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)

    def apply_bitmask(self, logits, bitmask, rows=None) -> None:
        pass  # every token allowed


class BoomPlugin:
    @hookimpl
    def register_structured_output_backends(self, register):
        register("boom", BoomBackend)


def make_engine(model: str) -> AsyncEngine:
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(BoomPlugin())
    config = EngineConfig.from_dict({
        "model": model, "dtype": "float32", "max_num_seqs": 16, "max_num_batched_tokens": 128,
        "block_size": 8, "num_gpu_blocks_override": 128, "max_model_len": 256,
        "structured_output_backend": "boom"})
    return AsyncEngine(config, plugin_manager=pm)


async def run(engine: AsyncEngine, with_boom: bool) -> tuple[list[list[int]], Exception | None]:
    results: dict[int, list[int]] = {}
    failure: list[Exception] = []

    async def free(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        async for out in engine.generate(PROMPTS[i], params):
            results[i] = out.outputs[0].token_ids

    async def boom() -> None:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(regex=".*"))
        try:
            async for _ in engine.generate("This one will fail:", params):
                pass
        except RequestFailed as e:
            failure.append(e)

    async with engine:
        async with anyio.create_task_group() as tg:
            if with_boom:
                tg.start_soon(boom)
            for i in range(len(PROMPTS)):
                tg.start_soon(free, i)
        free_blocks, total = engine.num_free_blocks, engine.num_total_blocks
        assert engine.num_unfinished_requests == 0
    assert free_blocks == total
    return [results[i] for i in range(len(PROMPTS))], failure[0] if failure else None


@pytest.mark.parametrize("family", ["llama"])
def test_a_failing_grammar_plugin_ends_its_request_alone(tiny_models, family):
    clean, _ = anyio.run(run, make_engine(tiny_models[family]), False)
    got, failure = anyio.run(run, make_engine(tiny_models[family]), True)
    assert failure is not None and "the test grammar exploded" in str(failure)
    assert got == clean
