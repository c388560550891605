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


@dataclass
class KVSleep:
    """What waking needs to allocate the cache again: each layer's shape and dtype."""

    layers: list[tuple[tuple[int, ...], torch.dtype, torch.device]]

    @staticmethod
    def possible(engine: Any) -> bool:
        return engine.device.type == "cpu" and engine.parts.parallel is None and bool(
            engine.runner.kv_caches)

    @classmethod
    def release(cls, engine: Any) -> KVSleep | None:
        """Free the engine's KV cache; None (nothing freed) while a block is still in use."""
        runner = engine.runner
        if engine.num_unfinished_requests or not engine.scheduler.reset_prefix_cache():
            return None  # (cached blocks are forgotten: they would point at nothing)
        state = cls([(tuple(c.shape), c.dtype, c.device) for c in runner.kv_caches])
        runner.kv_caches = []
        return state

    def restore(self, engine: Any) -> None:
        """Allocate the cache again (in a thread: zeroing it is the slow part)."""
        caches = engine.device.run_at_start_up(lambda: [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in
            self.layers])
        backend = getattr(engine.runner, "attn_backend", None)
        if backend is not None:
            backend.bind_kv_cache(caches)
        engine.runner.kv_caches = caches


def engine_bytes(engine: Any) -> int:
    """The bytes of an engine's weights (each storage once) and KV cache."""
    seen: set[int] = set()
    total = 0
    model = engine.runner.model
    for t in (*model.parameters(), *model.buffers()):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total + sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)


def return_memory() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise: the server's
    resident set would not fall after an unload)."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
