"""The encoder's outputs, kept by image hash under a budget in tokens (least recently used
first out). Touched on the device only (the step's forward pass), in step order.

An image is encoded once while its output stays: a prompt's chunks that split its
placeholders read slices of one output, a follow-up turn that misses the prefix cache (or a
preempted request recomputing) finds it here. An output larger than the whole budget is used
for its step and not kept. Which outputs stay is decided on the loop, when the step is
scheduled (``core/encoder_budget.py``): each step's plan drops outputs (``drop``) and names
those kept; the least-recently-used order here only backs that up."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self.used = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        out = self._entries.get(key)
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return out

    def put(self, key: bytes, value: torch.Tensor) -> None:
        n = value.shape[0]
        if key in self._entries or n > self.budget:
            return
        while self.used + n > self.budget:
            _, old = self._entries.popitem(last=False)
            self.used -= old.shape[0]
        self._entries[key] = value
        self.used += n

    def drop(self, keys: list[bytes]) -> None:
        for key in keys:
            out = self._entries.pop(key, None)
            if out is not None:
                self.used -= out.shape[0]

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
