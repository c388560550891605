"""torch_paged: attention over the paged KV cache with PyTorch SDPA (CPU, and a reference).

Once per step (in the first layer's ``forward``), the batch is split into *groups*, each
attended by ONE SDPA call shared by all layers' index tensors and masks:

- all pure decodes (query_len 1) form one group. While their longest context fits in one
  chunk (``DECODE_CHUNK_TOKENS``), their blocks are gathered through the block tables into a
  padded ``[B, max_blocks * block_size]`` view, masked by length. Longer contexts are read
  chunk by chunk (flash-decoding, ``decode_chunks.py``): the KV copy alive at a time is one
  chunk of the rows that reach it, never every sequence's whole padded history, and the
  chunks' partial results are merged exactly through their log-sum-exps;
- prefill chunks are packed into padded groups while padding at most doubles the work
  (one fresh prompt alone attends its own k/v with ``is_causal``, no gather).

Layer variants (``AttentionOptions``): a sliding window narrows the masks (the in-place decode
kernel starts each request's keys at ``len - window``); a soft cap (Gemma 2) takes the explicit
``softmax(cap * tanh(q k^T / cap))`` in place of SDPA, which has no soft cap. Models with such
layers never take the chunked decode path.

GQA without copying K/V: the ``group = heads / kv_heads`` query heads sharing a KV head are
folded into the query-row axis, so SDPA sees ``[G, kv_heads, Q * group, head_dim]`` queries
against ``[G, kv_heads, L, head_dim]`` keys.

On the CPU in eager mode (float32, bfloat16: ``kernels/layer_ops.usable``) the decodes instead
form one ``CppDecode`` group: the own kernel ``decode_attention.cpp`` reads each request's
blocks in place through its block table, with no gather copy, no padding and no mask, and the
step's K/V are written by one ``kv_write`` call instead of two ``index_copy_``. A step with
prefill chunks there makes every token such a row (its length is its causal limit), up to
``torch_paged_plan.ROWS_TABLE_MAX`` table entries: 2-3x faster than PyTorch's CPU flash kernel
on a prompt of 95 to 400 tokens. The SDPA groups above remain the path for longer chunks, for
other dtypes and devices, and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.executor.attention.base import (
    PLAIN,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)
from asyncengine.executor.attention.decode_chunks import (
    ChunkedDecode,
    chunked_decode,
)
from asyncengine.executor.attention.torch_paged_plan import (
    CppDecode,
    StepPlan,
    make_plan,
)
from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kv.dtype import index_copy, to_cache


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"
    #: Some layer has a window or a soft cap: no chunked decode (it knows neither).
    variants: bool = False
    #: The cache's dtype, where it is not the activations' (``--kv-cache-dtype fp8``).
    kv_dtype: torch.dtype | None = None

    def configure_layers(self, options: list[AttentionOptions]) -> None:
        self.variants = any(o != PLAIN for o in options)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_dtype = kv_caches[0].dtype if kv_caches else None

    def prepare(self, metadata: AttentionMetadata) -> None:
        # prepare() runs on the event loop's thread. The plan's tensors (a prefill's mask is
        # [G, Q, L]) are big enough for parallel kernels, and a thread that runs one keeps an
        # OpenMP team for good: two teams on the cores slow every later forward pass (see
        # executor/build.py, _off_the_loop_thread). So the first layer's forward builds the plan,
        # on the device's thread.
        metadata.extra = None

    def decode_plan(self, metadata: AttentionMetadata, x: torch.Tensor,
                    kv_heads: int) -> CppDecode | None:
        """The step's in-place decode attention, when every token of the step is a decode that
        ``decode_attention.cpp`` attends (rows 0 .. T-1 in order, K/V written by ``kv_write``);
        else None. ``x``: any of the step's activations (its dtype and device decide). For
        callers that run the layers' kernels themselves (``models/decode_stack.py``)."""
        plan: StepPlan | None = metadata.extra
        if plan is None:
            plan = metadata.extra = make_plan(metadata, x, kv_heads, self.variants,
                                              self.kv_dtype)
        if (plan.cpp and plan.identity and plan.all_decodes
                and isinstance(plan.groups[0], CppDecode)):
            return plan.groups[0]
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        plan: StepPlan | None = metadata.extra
        if plan is None:
            plan = metadata.extra = make_plan(metadata, q, kv_cache.shape[3], self.variants,
                                              kv_cache.dtype)
        window, cap = options.window, options.soft_cap
        T, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        if plan.cpp and layer_ops.usable(q):
            layer_ops.kv_write(k, v, kv_cache, metadata.slot_mapping)
        else:
            k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, dim]
            index_copy(k_cache.view(-1, num_kv_heads, head_dim), 0, metadata.slot_mapping,
                       to_cache(k, kv_cache.dtype))
            index_copy(v_cache.view(-1, num_kv_heads, head_dim), 0, metadata.slot_mapping,
                       to_cache(v, kv_cache.dtype))
        out = None if plan.identity else q.new_empty(T, num_heads, head_dim)
        for g in plan.groups:
            if isinstance(g, CppDecode):
                o = layer_ops.decode_attention(q, kv_cache, g.tables, g.lens, g.rows, g.split,
                                               scale, window, cap)
                if out is None:
                    return o
                out[g.rows] = o
                continue
            if isinstance(g, ChunkedDecode):
                o = chunked_decode(g, q, kv_cache, scale)
                if out is None:
                    return o
                out[g.dest_rows] = o
                continue
            if g.fresh is not None:
                s, e = g.fresh
                kf, vf = k[s:e], v[s:e]
                if kv_cache.dtype != q.dtype:  # its K/V as the cache holds them (float8)
                    kf, vf = (to_cache(x, kv_cache.dtype).to(q.dtype) for x in (kf, vf))
                qf, kf, vf = q[s:e].transpose(0, 1), kf.transpose(0, 1), vf.transpose(0, 1)
                if options == PLAIN:
                    # 4-D (a batch of one): PyTorch's CPU flash kernel takes only 4-D inputs
                    # (3-D ones fall back to the unfused math path: 1.3x / 1.8x / 3.5x the
                    # time of a 95 / 160 / 400-token prompt's attention in bfloat16).
                    o = F.scaled_dot_product_attention(qf[None], kf[None], vf[None],
                                                       is_causal=True, scale=scale,
                                                       enable_gqa=True)[0]  # [heads, L, dim]
                else:
                    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
                    o = _attend(qf, kf, vf, _fresh_mask(e - s, window, q), scale, cap)
                o = o.transpose(0, 1)
                if out is None:
                    return o
                out[s:e] = o
                continue
            G, Q = g.token_rows.shape
            if g.ordered:  # consecutive rows, no padding: a view, no gather
                qg = q[g.first_row:g.first_row + G * Q].reshape(G, Q, num_heads, head_dim)
            else:
                qg = q[g.token_rows]  # [G, Q, heads, dim]
            qg = qg.view(G, Q, num_kv_heads, group, head_dim).transpose(1, 2)
            qg = qg.reshape(G, num_kv_heads, Q * group, head_dim)
            kg, vg = _gather(kv_cache, g.blocks, q.dtype)  # [G, kv_heads, L, dim] each
            mask = g.mask_for(group, q.dtype, window)
            if cap is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask,
                                                   scale=scale)  # [G, kv_heads, Q * group, dim]
            else:
                o = _attend(qg, kg, vg, mask, scale, cap)
            o = o.view(G, num_kv_heads, Q, group, head_dim).transpose(1, 2)
            o = o.reshape(G * Q, num_heads, head_dim)
            if out is None:
                return o
            if g.ordered:
                out[g.first_row:g.first_row + G * Q] = o
                continue
            if g.valid is not None:
                o = o[g.valid]
            out[g.dest_rows] = o
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, cap: float | None) -> torch.Tensor:
    """``softmax(cap * tanh(q k^T * scale / cap) + mask) v`` in float32 (SDPA has no soft
    cap). q: [..., Q, D], k, v: [..., L, D] with the same heads; mask additive [..., Q, L]."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    if mask is not None:
        s = s + mask
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _fresh_mask(n: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    """The additive causal mask of one fresh prompt of ``n`` tokens, within ``window``."""
    i = torch.arange(n, device=like.device)
    keep = i[None, :] <= i[:, None]
    if window is not None:
        keep &= i[None, :] > i[:, None] - window
    return torch.zeros(n, n, dtype=torch.float32, device=like.device).masked_fill_(
        ~keep, float("-inf"))


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [2, num_blocks, bs, kv_heads, dim], blocks [G, n] -> K, V: [G, kv_heads, n*bs, dim]
    each, in ``dtype``."""
    G, n = blocks.shape
    _, _, bs, kv_heads, dim = kv_cache.shape
    flat = blocks.flatten()
    # Two copies along dim 0 (a row copy per block): one index_select along dim 1 of the
    # whole cache is faster on average but, measured, ~1.5x slower in some processes.
    k, v = (kv_cache[i].index_select(0, flat).to(dtype).view(G, n * bs, kv_heads, dim)
            .transpose(1, 2) for i in (0, 1))  # .to: a float8 cache widened
    return k, v


