"""Images whose placeholders attend to each other both ways (Gemma 3), over any backend.

Such an image is computed whole in one step (the scheduler does not split it:
``core/multimodal.chunk_without_split``). A step with one wraps its backend for the forward
pass: each layer's attention runs as the backend does it (causal: it also writes the K/V),
then the image's own rows are attended again over their request's keys with the mask
transformers uses, ``(causal or same image) and within the window``, and replace the causal
rows. Only steps that compute such an image pay this; its cost is one image's rows against
its prefix, per layer."""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.executor.attention.base import PLAIN, AttentionOptions


class ImageSpanAttention:
    """The step's backend, with the rows of ``spans`` (``mm_step.MMSlice``: whole images)
    attended bidirectionally within each image."""

    def __init__(self, inner: Any, spans: list[Any]) -> None:
        self.inner = inner
        self.spans = spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        out = self.inner.forward(q, k, v, kv_cache, metadata, scale, options)
        for span in self.spans:
            rows = slice(span.flat, span.flat + span.hi - span.lo)
            out[rows] = _image_rows(q[rows], kv_cache, span, scale, options)
        return out


def _image_rows(q: torch.Tensor, kv_cache: torch.Tensor, span: Any, scale: float,
                options: AttentionOptions) -> torch.Tensor:
    """q [n, heads, dim] of one whole image -> its attention output [n, heads, dim]."""
    n, heads, dim = q.shape
    first = span.item.offset  # the image's first position
    start = first + span.lo  # its rows' positions: start .. start + n (all of it: lo = 0)
    length = start + n  # keys 0 .. length - 1: the prefix and the image
    blocks = span.blocks.to(kv_cache.device)
    _, _, bs, kv_heads, _ = kv_cache.shape
    k, v = (kv_cache[i].index_select(0, blocks).reshape(-1, kv_heads, dim)[:length]
            .to(q.dtype).transpose(0, 1) for i in (0, 1))  # [kv_heads, L, dim]
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    qpos = torch.arange(start, length, device=q.device)[:, None]
    kpos = torch.arange(length, device=q.device)[None, :]
    keep = (kpos <= qpos) | (kpos >= first)
    if options.window is not None:
        keep &= kpos > qpos - options.window
    s = torch.matmul(q.transpose(0, 1).float(), k.float().transpose(-1, -2)) * scale
    if options.soft_cap is not None:
        s = torch.tanh(s / options.soft_cap) * options.soft_cap
    s = s.masked_fill(~keep, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), v.float())  # [heads, n, dim]
    return o.transpose(0, 1).to(q.dtype)
