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
form one ``_CppDecode`` group: the own kernel ``decode_attention.cpp`` reads each request's
blocks in place through its block table, with no gather copy, no padding and no mask, and the
step's K/V are written by one ``kv_write`` call instead of two ``index_copy_``. The SDPA
groups above remain the path for prefills, for other dtypes and devices, and the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from asyncengine.executor.attention.base import (
    PLAIN,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)
from asyncengine.executor.attention.decode_chunks import (
    DECODE_CHUNK_TOKENS,
    ChunkedDecode,
    chunked_decode,
    make_chunked_decode,
)
from asyncengine.executor.kernels import layer_ops

# Prefill chunks share a padded SDPA call while padded work <= SLACK * real work + FREE.
_SLACK = 2.0
_FREE = 16384


@dataclass
class _Group:
    """Requests attended in one SDPA call."""

    max_q: int
    token_rows: torch.Tensor | None = None  # [G, Q] rows of q (padding repeats a real row)
    blocks: torch.Tensor | None = None  # [G, max_blocks] block ids (padding: block 0)
    mask: torch.Tensor | None = None  # [G, 1, Q, L] True = attend; None = attend all
    last_key: torch.Tensor | None = None  # [G, Q] the last key position each row attends
    valid: torch.Tensor | None = None  # rows of the flat [G * Q] output that are real
    dest_rows: torch.Tensor | None = None  # [n_valid] rows of the step output they fill
    fresh: tuple[int, int] | None = None  # (start, end): one prompt with no cached context
    ordered: bool = False  # no padding, and the rows are consecutive step rows
    first_row: int = 0
    num_rows: int = 0
    block_size: int = 0
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask_for(self, group: int, dtype: torch.dtype,
                 window: int | None = None) -> torch.Tensor | None:
        """The mask with each query row repeated ``group`` times (rows are (t, head) pairs), made
        additive in ``dtype`` (0 / -inf: what SDPA turns a boolean mask into, once per layer
        otherwise), once per step; ``window`` narrows it to the last ``window`` keys."""
        if self.mask is None and window is None:
            return None
        key = (group, dtype, window)
        if key not in self._masks:
            mask = self.mask
            if window is not None:
                L = self.blocks.shape[1] * self.block_size
                keys = torch.arange(L, device=self.last_key.device)[None, None, :]
                inside = keys > (self.last_key[:, :, None] - window)  # [G, Q, L]
                mask = inside[:, None] if mask is None else mask & inside[:, None]
            mask = mask if self.max_q == 1 else mask.repeat_interleave(group, dim=2)
            self._masks[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device
                                           ).masked_fill_(~mask, float("-inf"))
        return self._masks[key]


@dataclass
class _CppDecode:
    """The step's decodes, attended by ``layer_ops.decode_attention`` (cache read in place)."""

    rows: torch.Tensor  # [B] int64: each decode's row of q (and of the step output)
    tables: torch.Tensor  # [B, n] int64 block tables, contiguous
    lens: torch.Tensor  # [B] int64 keys per request
    split: int  # positions per work item


@dataclass
class _Plan:
    groups: list[_Group | ChunkedDecode | _CppDecode]
    identity: bool  # one group whose output rows are exactly the step's rows, in order
    cpp: bool  # K/V written by the CPU kernel


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"
    #: Some layer has a window or a soft cap: no chunked decode (it knows neither).
    variants: bool = False

    def configure_layers(self, options: list[AttentionOptions]) -> None:
        self.variants = any(o != PLAIN for o in options)

    def prepare(self, metadata: AttentionMetadata) -> None:
        # prepare() runs on the event loop's thread. The plan's tensors (a prefill's mask is
        # [G, Q, L]) are big enough for parallel kernels, and a thread that runs one keeps an
        # OpenMP team for good: two teams on the cores slow every later forward pass (see
        # executor/build.py, _off_the_loop_thread). So the first layer's forward builds the plan,
        # on the device's thread.
        metadata.extra = None

    def decode_plan(self, metadata: AttentionMetadata, x: torch.Tensor,
                    kv_heads: int) -> _CppDecode | None:
        """The step's in-place decode attention, when every token of the step is a decode that
        ``decode_attention.cpp`` attends (rows 0 .. T-1 in order, K/V written by ``kv_write``);
        else None. ``x``: any of the step's activations (its dtype and device decide). For
        callers that run the layers' kernels themselves (``models/decode_stack.py``)."""
        plan: _Plan | None = metadata.extra
        if plan is None:
            plan = metadata.extra = _make_plan(metadata, x, kv_heads, self.variants)
        if plan.cpp and plan.identity and isinstance(plan.groups[0], _CppDecode):
            return plan.groups[0]
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        plan: _Plan | None = metadata.extra
        if plan is None:
            plan = metadata.extra = _make_plan(metadata, q, kv_cache.shape[3], self.variants)
        window, cap = options.window, options.soft_cap
        T, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        if plan.cpp and layer_ops.usable(q):
            layer_ops.kv_write(k, v, kv_cache, metadata.slot_mapping)
        else:
            k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, dim]
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        out = None if plan.identity else q.new_empty(T, num_heads, head_dim)
        for g in plan.groups:
            if isinstance(g, _CppDecode):
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
                qf, kf, vf = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                if options == PLAIN:
                    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale,
                                                       enable_gqa=True)  # [heads, L, dim]
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
            kg, vg = _gather(kv_cache, g.blocks)  # [G, kv_heads, L, dim] each
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


def _make_plan(metadata: AttentionMetadata, q: torch.Tensor, kv_heads: int,
               variants: bool = False) -> _Plan:
    device = metadata.slot_mapping.device
    q_lens, seq_lens = metadata.query_lens, metadata.seq_lens
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    groups: list[_Group | ChunkedDecode | _CppDecode] = []
    cpp = layer_ops.usable(q)
    if decodes and cpp:
        groups.append(_cpp_decode(decodes, metadata, kv_heads))
    elif decodes:
        longest = max(seq_lens[i] for i in decodes)
        if longest > DECODE_CHUNK_TOKENS and device.type == "cpu" and not variants:
            groups.append(make_chunked_decode(decodes, metadata, device))
        else:
            groups.append(_padded_group(decodes, metadata, device))
    for members in _pack(prefills, q_lens, seq_lens):
        i = members[0]
        if len(members) == 1 and q_lens[i] == seq_lens[i]:
            start = metadata.query_start_loc[i]
            groups.append(_Group(max_q=q_lens[i], fresh=(start, start + q_lens[i])))
        else:
            groups.append(_padded_group(members, metadata, device))
    total = metadata.query_start_loc[-1]
    first = groups[0]
    if isinstance(first, _CppDecode):
        identity = len(groups) == 1 and len(decodes) == total
    else:
        identity = len(groups) == 1 and not isinstance(first, ChunkedDecode) and (
            first.fresh == (0, total) or (first.ordered and first.num_rows == total))
    return _Plan(groups, identity, cpp)


def _cpp_decode(decodes: list[int], meta: AttentionMetadata, kv_heads: int) -> _CppDecode:
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens
    tables = meta.block_tables
    if len(decodes) == tables.shape[0]:  # every request decodes: rows 0..B-1 in order
        lens = seq_lens
        rows = torch.arange(len(decodes))
    else:
        lens = [seq_lens[i] for i in decodes]
        rows = torch.tensor([qsl[i] for i in decodes])
        tables = tables[torch.tensor(decodes)]
    split = layer_ops.decode_split(lens, kv_heads, meta.block_size, torch.get_num_threads())
    return _CppDecode(rows=rows, tables=tables.contiguous(), lens=torch.tensor(lens),
                      split=split)


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [2, num_blocks, bs, kv_heads, dim], blocks [G, n] -> K, V: [G, kv_heads, n*bs, dim]
    each."""
    G, n = blocks.shape
    _, _, bs, kv_heads, dim = kv_cache.shape
    flat = blocks.flatten()
    # Two copies along dim 0 (a row copy per block): one index_select along dim 1 of the
    # whole cache is faster on average but, measured, ~1.5x slower in some processes.
    k, v = (kv_cache[i].index_select(0, flat).view(G, n * bs, kv_heads, dim).transpose(1, 2)
            for i in (0, 1))
    return k, v


def _pack(reqs: list[int], q_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Greedily group requests (by length) while padding stays cheap."""
    groups: list[list[int]] = []
    cur: list[int] = []
    real = max_q = max_kv = 0
    for i in sorted(reqs, key=lambda i: (seq_lens[i], q_lens[i])):
        r = real + q_lens[i] * seq_lens[i]
        mq, mk = max(max_q, q_lens[i]), max(max_kv, seq_lens[i])
        if cur and (len(cur) + 1) * mq * mk > _SLACK * r + _FREE:
            groups.append(cur)
            cur, r, mq, mk = [], q_lens[i] * seq_lens[i], q_lens[i], seq_lens[i]
        cur.append(i)
        real, max_q, max_kv = r, mq, mk
    if cur:
        groups.append(cur)
    return groups


def _padded_group(members: list[int], meta: AttentionMetadata, device: torch.device) -> _Group:
    bs = meta.block_size
    qsl = meta.query_start_loc
    q_lens = [qsl[i + 1] - qsl[i] for i in members]
    seq_lens = [meta.seq_lens[i] for i in members]
    Q = max(q_lens)
    n_blocks = [(s + bs - 1) // bs for s in seq_lens]
    max_blocks = max(n_blocks)
    rows = [[qsl[i] + min(t, n - 1) for t in range(Q)]
            for i, n in zip(members, q_lens, strict=True)]
    token_rows = torch.tensor(rows, dtype=torch.long)  # [G, Q]
    q_len_t = torch.tensor(q_lens)
    ctx = torch.tensor(seq_lens) - q_len_t  # [G] tokens before this step's
    t = torch.arange(Q)
    real = t[None, :] < q_len_t[:, None]  # [G, Q]
    last_key = torch.where(real, ctx[:, None] + t[None, :], 0)  # [G, Q] causal limit
    mask = torch.arange(max_blocks * bs)[None, None, :] <= last_key[:, :, None]  # [G, Q, L]
    tables = meta.block_tables
    if len(members) == tables.shape[0] and members == list(range(len(members))):
        blocks = tables[:, :max_blocks]
    else:
        blocks = tables[torch.tensor(members, device=tables.device), :max_blocks]
    group = _Group(max_q=Q, token_rows=token_rows.to(device), blocks=blocks.to(device),
                   last_key=last_key.to(device), block_size=bs)
    if not bool(mask.all()):
        group.mask = mask[:, None].to(device)
    flat_rows = token_rows.flatten()
    if bool(real.all()):
        group.dest_rows = flat_rows.to(device)
        flat = flat_rows.tolist()
        group.ordered = flat == list(range(flat[0], flat[0] + len(flat)))
        group.first_row, group.num_rows = flat[0], len(flat)
    else:
        valid = real.flatten().nonzero().squeeze(1)
        group.valid = valid.to(device)
        group.dest_rows = flat_rows[valid].to(device)
    return group
