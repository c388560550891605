"""Helpers for the speculative-decoding tests: engines with drafts, an oracle proposer."""

from __future__ import annotations

import random

import anyio

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.engine.engine import AsyncEngine

# Speculating at every batch size (the default table turns it off above 4 running requests,
# and these tests run more at once).
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, ' \
        '"prompt_lookup_min": 1, "num_speculative_tokens_per_batch_size": [[1, 1024, 4]]}'


def make_engine(model: str, spec: str | None = NGRAM, **overrides) -> AsyncEngine:
    values = {"model": model, "dtype": "float32", "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "block_size": 8, "num_gpu_blocks_override": 96,
              "max_model_len": 256, **overrides}
    if spec is not None:
        values["speculative_config"] = spec
    return AsyncEngine(EngineConfig.from_dict(values))


class Oracle:
    """Proposes the continuation a reference run produced, with one token in two drafts
    corrupted: drafts are accepted in part, rejected in part, at every position."""

    def __init__(self, references: list[list[int]], seed: int = 0,
                 wrong_token: int = 7) -> None:
        self.references = references  # prompt + output token ids of each reference run
        self.rng = random.Random(seed)
        self.wrong = wrong_token
        self.num_proposals = 0

    def propose(self, request, k: int) -> list[int]:
        tokens = request.all_token_ids
        for ref in self.references:
            if ref[:len(tokens)] == tokens:
                out = list(ref[len(tokens):len(tokens) + k])
                break
        else:
            out = [self.wrong] * k  # nothing known: all wrong
        if out and self.rng.random() < 0.5:
            i = self.rng.randrange(len(out))
            out[i] = self.wrong if out[i] != self.wrong else self.wrong + 1
        self.num_proposals += 1
        return out


class SpecCounter:
    """Counts what the scheduler saw: steps with drafts, drafts and accepted drafts."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.steps = self.drafts = self.accepted = 0
        real = engine.scheduler.update_from_output

        def update(out, result):
            for s in out.scheduled:
                if s.spec_token_ids:
                    self.steps += 1
                    self.drafts += len(s.spec_token_ids)
                    tokens = result.spec_token_ids.get(s.request.request_id)
                    if tokens is not None:
                        self.accepted += len(tokens) - 1
            return real(out, result)

        engine.scheduler.update_from_output = update


async def generate_all(engine: AsyncEngine, prompts: list, params: SamplingParams | list
                       ) -> list:
    """The final outputs (RequestOutput) of the prompts, run concurrently."""
    results: dict[int, object] = {}
    plist = params if isinstance(params, list) else [params] * len(prompts)

    async def one(i: int) -> None:
        async for out in engine.generate(prompts[i], plist[i]):
            results[i] = out

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


def pool_is_free(engine: AsyncEngine) -> bool:
    stats = engine.scheduler.make_stats()
    return stats.num_free_blocks == stats.num_total_blocks
