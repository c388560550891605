"""``AsyncEngine.embed``: embeddings of token-id prompts, computed on the engine's device.

The forward pass (``executor/models/pooling.py``) is submitted through the engine's ``Device``,
like a step: its one worker thread runs it in launch order between two steps, never at the
same time as one, and the event loop keeps serving while it runs. It uses a KV cache of its
own and none of the runner's per-step state, so it may sit between step N and a step N+1
launched before N finished. Prompts are grouped so that one submission
holds at most ``--max-num-batched-tokens`` tokens (or one prompt): a large request delays
the steps of running generations by about one prefill of that size at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from asyncengine.engine.errors import EngineDeadError
from asyncengine.executor.models.pooling import embed_batch


def embedding_size(engine: Any) -> int:
    """The length of the vectors ``embed`` returns (the model's hidden size)."""
    return int(engine.runner.model.hidden_size)


async def embed(engine: Any, prompts: list[list[int]], *, pooling: str | None = None,
                normalize: bool = True) -> np.ndarray:
    """``[len(prompts), hidden]`` float32 vectors. ``pooling``: ``last`` or ``mean`` (default:
    ``--pooling-type``). Raises ValueError for an empty or too long prompt."""
    pooling = pooling or engine.config.model.pooling_type
    runner = engine.runner
    out = await on_device(engine, prompts, lambda batch: partial(
        embed_batch, runner.model, runner.attn_backend, runner.block_size, runner.device,
        engine.parts.dtype, batch, pooling, normalize))
    return np.concatenate(out) if out else np.zeros((0, embedding_size(engine)), np.float32)


async def on_device(engine: Any, prompts: list[list[int]],
                    work: Callable[[list[list[int]]], Callable[[], np.ndarray]]
                    ) -> list[np.ndarray]:
    """``work(batch)()`` run on the engine's device for each batch of at most
    ``--max-num-batched-tokens`` tokens of ``prompts`` (checked first: none empty or past the
    context), in order; their results."""
    if engine.error is not None:
        raise EngineDeadError(f"the engine stopped after an error: {engine.error}")
    if engine.config.parallel.tensor_parallel_size > 1:
        raise ValueError("embeddings and scores are not served with --tensor-parallel-size > 1 "
                         "(yet)")
    limit = engine.max_model_len
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input {i} is empty")
        if len(p) > limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, "
                             f"input {i} has {len(p)} tokens; shorten it.")
    budget = engine.config.scheduler.max_num_batched_tokens
    out: list[np.ndarray] = []
    for batch in _batches(prompts, budget):
        # Queued behind the steps already launched; the next ones queue behind it.
        out.append(await engine.device.launch(work(batch)).wait())
    return out


def _batches(prompts: list[list[int]], budget: int) -> list[list[list[int]]]:
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    tokens = 0
    for p in prompts:
        if current and tokens + len(p) > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(p)
        tokens += len(p)
    if current:
        batches.append(current)
    return batches
