"""Tensor parallelism (``--tensor-parallel-size`` > 1), rank 0's side of a step.

Rank 0's runner (``parallel/runner.TPModelRunner``) packs, in ``prepare``, what the workers
need and cannot know (``parallel/messages.encode_step``). Here, on the device's thread in step
order, the tokens still in flight are filled in, the message is broadcast, and rank 0's shard
runs the per-layer decoder: from there on every collective pairs with the workers'
(``parallel/worker.py``). Sampling, penalties and grammar masks stay on rank 0. It takes every
step: the workers must see each one.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from asyncengine.executor.paths.base import PathContext, StepPath


class TensorParallel(StepPath):
    name = "tensor_parallel"
    total = True

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        return "one rank" if ctx.tp is None else None

    def __init__(self, ctx: PathContext) -> None:
        super().__init__(ctx)
        self.tp = ctx.tp

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor:
        r = self.runner
        inputs.begun = True
        if inputs.from_previous is not None:
            dst, src = inputs.from_previous
            inputs.input_ids[dst] = last_sampled[src]
        msg = inputs.tp_message
        start = time.perf_counter()
        self.tp.broadcast(torch.from_numpy(msg.header))
        self.tp.broadcast(msg.body(inputs.input_ids))
        r.message_s += time.perf_counter() - start
        r.num_messages += 1
        r.attn_backend.plan(inputs.attn_metadata)
        return r.model(inputs.input_ids, inputs.positions, r.kv_caches, inputs.attn_metadata,
                       r.attn_backend)

    def describe(self) -> str:
        return f"tensor_parallel ({self.tp.world_size} ranks, rank 0's shard per layer)"
