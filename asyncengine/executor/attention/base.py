"""The attention-backend interface: paged KV cache layout, per-step metadata, attention.

KV-cache layout (one tensor per layer, allocated by the backend)::

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]   # 0 = K, 1 = V

A token at absolute position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

One step's tokens are flattened: the ``T`` query tokens of ``B`` requests are laid end to end,
request ``i`` owning ``[query_start_loc[i], query_start_loc[i + 1])``. Its query tokens are
the *last* ``query_len`` of its ``seq_len`` tokens (everything before is already in the cache:
a cached prefix, earlier chunks, earlier decode steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    query_start_loc: list[int]  # [B + 1], cumulative query lengths
    seq_lens: list[int]  # [B], tokens in the cache after this step (context + query)
    # [B, max blocks of the step] int64: row i's first ceil(seq_lens[i] / block_size) entries
    # are its blocks; entries past them are stale (any valid block id), never attended.
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, where each query token's K/V is written
    block_size: int
    # Backend-specific precomputed tensors (index tensors, masks, planned wrappers).
    extra: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]


class AttentionBackend(ABC):
    """Computes causal attention of one step's query tokens over the paged KV cache.

    ``prepare`` runs once per step (before the forward); ``forward`` once per layer.
    """

    name: str = "base"

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Fill ``metadata.extra`` with whatever the per-layer calls share."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into ``kv_cache`` at ``metadata.slot_mapping``, then attend causally."""
