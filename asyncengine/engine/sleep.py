"""Sleep level 1 on the CPU: the KV cache freed, the weights kept; and the memory an engine
holds.

vLLM's level 1 offloads the weights to host memory and discards the KV cache; on the CPU the
weights already are host memory, so level 1 frees the cache alone and waking allocates it
again (zeroed, as at start-up) and forgets the prefix cache's blocks, whose contents went
with it. Level 2 drops the engine altogether: waking reloads it from its files (the registry
does that). A tensor-parallel engine, whose workers hold caches of their own, and an engine on
CUDA (whose CUDA graphs captured the cache's addresses) sleep at level 2 only.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass
from typing import Any

import torch

Layer = tuple[tuple[int, ...], torch.dtype, torch.device]


@dataclass
class KVSleep:
    """What waking needs to allocate the caches again: each layer's shape and dtype, for the
    engine's runner and, with speculative decoding by a draft model, the draft's."""

    layers: list[list[Layer]]

    @staticmethod
    def possible(engine: Any) -> bool:
        return engine.device.kv_reallocatable and engine.parts.parallel is None and bool(
            engine.runner.kv_caches)

    @staticmethod
    def runners(engine: Any) -> list[Any]:
        """The runners whose caches sleep: the engine's, and its draft model's (if any)."""
        drafting = getattr(getattr(engine, "loop", None), "drafting", None)
        draft = getattr(getattr(drafting, "proposer", None), "runner", None)
        return [engine.runner] + ([draft] if draft is not None else [])

    @classmethod
    def release(cls, engine: Any) -> KVSleep | None:
        """Free the engine's KV caches; None (nothing freed) while a block is still in use."""
        if engine.num_unfinished_requests or not engine.scheduler.reset_prefix_cache():
            return None  # (cached blocks are forgotten: they would point at nothing)
        runners = cls.runners(engine)
        state = cls([[(tuple(c.shape), c.dtype, c.device) for c in r.kv_caches]
                     for r in runners])
        for runner in runners:
            runner.kv_caches = []
        return state

    def restore(self, engine: Any) -> None:
        """Allocate the caches again (in a thread: zeroing them is the slow part)."""
        for runner, layers in zip(self.runners(engine), self.layers, strict=True):
            caches = engine.device.run_at_start_up(lambda layers=layers: [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape, dtype, device in layers])
            backend = getattr(runner, "attn_backend", None)
            if backend is not None:
                backend.bind_kv_cache(caches)
            runner.kv_caches = caches


def engine_bytes(engine: Any) -> int:
    """The bytes of an engine's weights (each storage once) and KV cache."""
    seen: set[int] = set()
    total = 0
    runners = KVSleep.runners(engine)
    tensors = [t for r in runners for t in (*r.model.parameters(), *r.model.buffers())]
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total + sum(c.numel() * c.element_size() for r in runners for c in r.kv_caches)


def return_memory() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise: the server's
    resident set would not fall after an unload)."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
