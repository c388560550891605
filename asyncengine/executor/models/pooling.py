"""Embeddings: the model's final (normed) hidden states pooled per prompt, on the device.

``embed_batch`` runs one forward pass over several prompts with a KV cache of its own, sized
for them and dropped afterwards, so it touches nothing a generation step uses. It must run
where steps run, one at a time: ``asyncengine.engine.embedding`` submits it through the
engine's ``Device`` (the worker thread), never concurrently with a step.

Pooling: ``last`` takes the hidden state of each prompt's last token (what decoder-only
embedding models such as Qwen3-Embedding are trained for), ``mean`` averages them all. The
vectors are L2-normalized unless asked not to be.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata


@torch.inference_mode()
def embed_batch(model: torch.nn.Module, attn_backend: AttentionBackend, block_size: int,
                device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
                pooling: str = "last", normalize: bool = True) -> np.ndarray:
    """``[len(prompts), hidden]`` float32 embeddings of token-id ``prompts``."""
    pooled = pool_batch(model, attn_backend, block_size, device, dtype, prompts, pooling)
    if normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled.cpu().numpy()


@torch.inference_mode()
def pool_batch(model: torch.nn.Module, attn_backend: AttentionBackend, block_size: int,
               device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
               pooling: str = "last") -> torch.Tensor:
    """``[len(prompts), hidden]`` float32 pooled final hidden states, left on ``device``."""
    bs = block_size
    lens = [len(p) for p in prompts]
    blocks = [-(-n // bs) for n in lens]
    first_block = np.cumsum([0, *blocks])
    kv_caches = attn_backend.allocate_kv_cache(
        model.num_layers, int(first_block[-1]), bs, model.num_kv_heads, model.head_dim, dtype,
        device)
    starts = np.cumsum([0, *lens])
    # Each prompt owns consecutive blocks, so its token p lives in slot first_block * bs + p.
    slots = np.concatenate([first_block[i] * bs + np.arange(n) for i, n in enumerate(lens)])
    table = _block_tables(first_block)
    meta = AttentionMetadata(
        query_start_loc=[int(s) for s in starts],
        seq_lens=lens,
        block_tables=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_size=bs,
        block_tables_host=table,
    )
    attn_backend.prepare(meta)
    attn_backend.plan(meta)
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(device)
    hidden = model(input_ids, positions, kv_caches, meta, attn_backend).float()  # [T, H]
    if pooling == "mean":
        segment = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                          torch.tensor(lens, device=device))
        pooled = torch.zeros(len(lens), hidden.shape[1], device=device).index_add_(
            0, segment, hidden) / torch.tensor(lens, device=device, dtype=torch.float32)[:, None]
    elif pooling == "last":
        pooled = hidden[torch.tensor(starts[1:] - 1, device=device)]
    else:
        raise ValueError(f"unknown pooling {pooling!r} (last, mean)")
    return pooled


def _block_tables(first_block: np.ndarray) -> np.ndarray:
    """``[B, max blocks]``: row i holds its consecutive blocks, padded with its first one."""
    counts = np.diff(first_block)
    width = int(counts.max())
    table = first_block[:-1, None] + np.minimum(np.arange(width)[None, :],
                                                np.maximum(counts - 1, 0)[:, None])
    return table.astype(np.int64)
