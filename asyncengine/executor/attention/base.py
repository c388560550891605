"""The attention-backend interface: paged KV cache layout, per-step metadata, attention.

KV-cache layout (one tensor per layer, allocated by the backend)::

    kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]   # 0 = K, 1 = V

A token at absolute position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

FlashInfer reads the same cache as a ``(k_cache, v_cache)`` pair of ``[num_pages, page_size,
num_kv_heads, head_dim]`` ("NHD") tensors: ``kv_cache[layer][0]`` and ``[1]``, views, no copy.
A KV block is a FlashInfer page; the block manager's block ids are the page indices.

One step's tokens are flattened: the ``T`` query tokens of ``B`` requests are laid end to end,
request ``i`` owning ``[query_start_loc[i], query_start_loc[i + 1])``. Its query tokens are
the *last* ``query_len`` of its ``seq_len`` tokens (everything before is already in the cache:
a cached prefix, earlier chunks, earlier decode steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention variant (Gemma, Mistral, Qwen2 with a window; the default is plain
    causal attention over the whole context).

    ``window``: the query at position ``p`` sees only keys at positions ``> p - window`` (itself
    and the ``window - 1`` before it: transformers' ``sliding_window``; FlashInfer's
    ``window_left`` is ``window - 1``). ``soft_cap``: scores become ``cap * tanh(score / cap)``
    after scaling, before the softmax (Gemma 2's ``attn_logit_softcapping``).
    """

    window: int | None = None
    soft_cap: float | None = None


PLAIN = AttentionOptions()


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    query_start_loc: list[int]  # [B + 1], cumulative query lengths
    seq_lens: list[int]  # [B], tokens in the cache after this step (context + query)
    # [B, max blocks of the step] int64: row i's first ceil(seq_lens[i] / block_size) entries
    # are its blocks; entries past them are stale (any valid block id), never attended.
    # None when the backend does not need it on the device (``needs_block_tables_tensor``).
    block_tables: torch.Tensor | None
    slot_mapping: torch.Tensor  # [T] int64, where each query token's K/V is written
    block_size: int
    # Backend-specific precomputed tensors (index tensors, masks, planned wrappers).
    extra: Any = None
    # The same block tables on the host, for backends that plan from them (FlashInfer).
    block_tables_host: np.ndarray | None = None
    # A pure-decode step replayed by the CUDA graph captured for this many rows: the rows
    # past num_reqs are padding, whose K/V go to the backend's scratch block.
    padded_batch: int | None = None
    # The step's requests where drafts make its rows more (a verification's last token and
    # each draft are query rows of their own, consecutive); None: one request a row.
    requests: int | None = None

    @property
    def num_reqs(self) -> int:
        """Query rows: a request's, or each of a verification's."""
        return len(self.seq_lens)

    @property
    def num_requests(self) -> int:
        return self.requests if self.requests is not None else len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]


class AttentionBackend(ABC):
    """Computes causal attention of one step's query tokens over the paged KV cache.

    ``prepare`` runs once per step on the event loop (host-side work only: no device
    synchronization, no kernels); ``plan`` once per step on the device side, in step order;
    ``forward`` once per layer.
    """

    name: str = "base"
    #: ``metadata.block_tables`` is needed on the device (else only ``block_tables_host``).
    needs_block_tables_tensor: bool = True
    #: Decode steps may be captured in CUDA graphs (static shapes, no host sync).
    supports_cuda_graphs: bool = False
    #: KV blocks the backend allocates past ``num_blocks`` for itself (a scratch block).
    extra_kv_blocks: int = 0

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

    def configure_layers(self, options: list[AttentionOptions]) -> None:  # noqa: B027
        """Once, after the model is built: each layer's options, in layer order (the same
        object is passed to that layer's ``forward``). Backends that plan per step for each
        distinct variant (FlashInfer) note them here."""

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:  # noqa: B027 (optional)
        """The engine's own cache, once allocated (not the temporary caches of profiling or
        embeddings): backends that keep blocks for themselves note where they are."""

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> None:
        """Fill ``metadata.extra`` with whatever the per-layer calls share."""

    def plan(self, metadata: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Device side, in step order, before the step's forward (or its CUDA graph replay):
        set up what the kernels read (FlashInfer's ``plan``). Nothing by default."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        options: AttentionOptions = PLAIN,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into ``kv_cache`` at ``metadata.slot_mapping``, then attend causally
        (within ``options.window``, with ``options.soft_cap``)."""
