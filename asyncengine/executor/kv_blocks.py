"""Whole KV blocks (all layers) copied out of and into the cache, for KV connectors.

On CUDA the copies run on the device's stream, so they are ordered with the steps: a block
loaded before a step is launched is in place when the step reads it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@torch.no_grad()
def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], device: torch.device,
                stream: Any = None) -> torch.Tensor:
    """``[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]``, a copy."""
    with _on(stream):
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        # cache: [2, num_blocks, block_size, kv_heads, head_dim] -> [n, 2, ...] per layer
        return torch.stack([c.index_select(1, idx).transpose(0, 1) for c in kv_caches], dim=1)


@torch.no_grad()
def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], kv: torch.Tensor,
                 device: torch.device, stream: Any = None) -> None:
    """Overwrite the blocks with ``kv``, shaped as :func:`read_blocks` returns."""
    cache = kv_caches[0]
    expected = (len(block_ids), len(kv_caches), 2, *cache.shape[2:])
    if tuple(kv.shape) != expected:
        raise ValueError(f"KV blocks of shape {tuple(kv.shape)} do not fit this cache "
                         f"(expected {expected})")
    with _on(stream):
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer, cache in enumerate(kv_caches):
            cache.index_copy_(1, idx, kv[:, layer].transpose(0, 1).to(cache.device, cache.dtype))
