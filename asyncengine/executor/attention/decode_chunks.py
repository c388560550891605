"""Decode attention over long paged contexts, chunk by chunk (flash-decoding).

The decode requests of a step (one query token each) are sorted by context length, longest
first, and their KV history is walked in chunks of ``DECODE_CHUNK_TOKENS`` positions. Chunk
``c`` covers block columns ``[c * C, (c + 1) * C)`` of the block tables and only the rows whose
context reaches it, which (sorted) are a prefix ``[0, m_c)`` of the rows: a short request stops
costing anything once its history ends, where one padded gather would copy and attend every
row up to the longest context.

Each chunk is one call of PyTorch's CPU flash-attention kernel, which returns the chunk's output
and the log-sum-exp of its scores; chunks are merged exactly in float32::

    lse = logaddexp(lse_a, lse_b);  o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

So the KV copy alive at a time is one chunk (``m_c * C`` positions), not every decode
sequence's whole padded history: at a batch of 64 contexts of 4,096 tokens the per-layer copy
drops from the whole batch's KV to an eighth of it.

GQA as in ``torch_paged``: the query heads that share a KV head are rows of one query matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.executor.attention.base import AttentionMetadata

# Positions of KV history attended per chunk (rounded down to whole blocks, at least one).
DECODE_CHUNK_TOKENS = 512

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class _Chunk:
    rows: int  # the first ``rows`` (sorted) requests reach this chunk
    blocks: torch.Tensor  # [rows, chunk blocks] block ids
    mask: torch.Tensor | None  # [rows, 1, 1, chunk tokens] True = attend; None = attend all
    _additive: dict[torch.dtype, torch.Tensor] | None = None

    def mask_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.mask is None:
            return None
        if self._additive is None:
            self._additive = {}
        if dtype not in self._additive:
            self._additive[dtype] = torch.zeros(self.mask.shape, dtype=dtype).masked_fill_(
                ~self.mask, float("-inf"))
        return self._additive[dtype]


@dataclass
class ChunkedDecode:
    """The plan of the step's decode requests, shared by all layers."""

    token_rows: torch.Tensor  # [B] rows of the step's q, longest context first
    dest_rows: torch.Tensor  # [B] the same rows: where the outputs go
    chunks: list[_Chunk]


def make_chunked_decode(members: list[int], meta: AttentionMetadata, device: torch.device,
                        chunk_tokens: int | None = None) -> ChunkedDecode:
    """``members``: indices of decode requests (query_len 1) in the step's metadata."""
    chunk_tokens = chunk_tokens or DECODE_CHUNK_TOKENS
    bs = meta.block_size
    order = sorted(members, key=lambda i: -meta.seq_lens[i])
    seq_lens = [meta.seq_lens[i] for i in order]
    rows = torch.tensor([meta.query_start_loc[i] for i in order], dtype=torch.long)
    tables = meta.block_tables[torch.tensor(order, device=meta.block_tables.device)]
    per_chunk = max(1, chunk_tokens // bs)
    longest_blocks = (seq_lens[0] + bs - 1) // bs
    lens = torch.tensor(seq_lens)
    chunks = []
    for first in range(0, longest_blocks, per_chunk):
        start = first * bs
        m = sum(1 for s in seq_lens if s > start)
        last = min(first + per_chunk, longest_blocks)
        width = (last - first) * bs
        valid = torch.arange(width)[None, :] < (lens[:m] - start)[:, None]  # [m, width]
        mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        chunks.append(_Chunk(m, tables[:m, first:last].to(device), mask))
    rows = rows.to(device)
    return ChunkedDecode(token_rows=rows, dest_rows=rows, chunks=chunks)


def chunked_decode(plan: ChunkedDecode, q: torch.Tensor, kv_cache: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, heads, dim] (the step's queries), kv_cache [2, blocks, bs, kv_heads, dim] ->
    [B, heads, dim]: the decode rows' outputs, in ``plan.token_rows`` order."""
    _, num_heads, dim = q.shape
    _, _, bs, kv_heads, _ = kv_cache.shape
    group = num_heads // kv_heads
    B = plan.token_rows.shape[0]
    qg = q.index_select(0, plan.token_rows).view(B, kv_heads, group, dim)  # [B, kv, g, dim]
    out = lse = None
    for chunk in plan.chunks:
        m, n = chunk.blocks.shape
        flat = chunk.blocks.flatten()
        k, v = (kv_cache[i].index_select(0, flat).to(q.dtype).view(m, n * bs, kv_heads, dim)
                .transpose(1, 2) for i in (0, 1))  # .to: a float8 cache widened
        o, l_c = _flash(qg[:m], k, v, 0.0, False, attn_mask=chunk.mask_for(q.dtype),
                        scale=scale)  # [m, kv, g, dim], [m, kv, g]
        if out is None:
            out, lse = o.float(), l_c.float()
            continue
        merged = torch.logaddexp(lse[:m], l_c)
        out[:m].mul_((lse[:m] - merged).exp_().unsqueeze(-1))
        out[:m].addcmul_(o.float(), (l_c - merged).exp_().unsqueeze(-1))
        lse[:m] = merged
    return out.to(q.dtype).view(B, num_heads, dim)
