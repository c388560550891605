"""torch_paged's plan of a step: the batch split into groups once per step (in the first
layer's ``forward``), each attended by one SDPA call or one in-place kernel call, shared by
all layers (``torch_paged.py`` explains the groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncengine.executor.attention.base import AttentionMetadata
from asyncengine.executor.attention.decode_chunks import (
    DECODE_CHUNK_TOKENS,
    ChunkedDecode,
    make_chunked_decode,
)
from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels.where import on_host

# Prefill chunks share a padded SDPA call while padded work <= SLACK * real work + FREE.
_SLACK = 2.0
_FREE = 16384
# A step whose prefill tokens' block tables (one row each, int64) fit this many entries takes
# the in-place kernel for every token (``_cpp_rows``); a longer chunk takes SDPA. For one
# prompt of 95 / 160 / 400 / 1000 tokens (2 threads, SmolLM2's 9 heads over 3 KV heads,
# bfloat16) a layer's attention took 78 / 177 / 960 / 5,550 us against PyTorch's CPU flash
# kernel's 233 / 440 / 2,290 / 10,200.
ROWS_TABLE_MAX = 1 << 20


@dataclass
class SDPAGroup:
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
class CppDecode:
    """The step's decodes, attended by ``layer_ops.decode_attention`` (cache read in place)."""

    rows: torch.Tensor  # [B] int64: each decode's row of q (and of the step output)
    tables: torch.Tensor  # [B, n] int64 block tables, contiguous
    lens: torch.Tensor  # [B] int64 keys per request
    split: int  # positions per work item


@dataclass
class StepPlan:
    groups: list[SDPAGroup | ChunkedDecode | CppDecode]
    identity: bool  # one group whose output rows are exactly the step's rows, in order
    cpp: bool  # K/V written by the CPU kernel
    all_decodes: bool = True  # every request's query is one token (a decode, a draft row)


def make_plan(metadata: AttentionMetadata, q: torch.Tensor, kv_heads: int,
              variants: bool = False, kv_dtype: torch.dtype | None = None) -> StepPlan:
    """``kv_dtype``: the cache's (None: q's)."""
    device = metadata.slot_mapping.device
    q_lens, seq_lens = metadata.query_lens, metadata.seq_lens
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    groups: list[SDPAGroup | ChunkedDecode | CppDecode] = []
    cpp = layer_ops.usable_kv(q, q.dtype if kv_dtype is None else kv_dtype)
    total = metadata.query_start_loc[-1]
    if prefills and cpp and total * metadata.block_tables.shape[1] <= ROWS_TABLE_MAX:
        # every token one row of the in-place kernel, prefill tokens included
        return StepPlan([_cpp_rows(metadata, kv_heads)], identity=True, cpp=True,
                        all_decodes=False)
    if decodes and cpp:
        groups.append(_cpp_decode(decodes, metadata, kv_heads))
    elif decodes:
        longest = max(seq_lens[i] for i in decodes)
        if longest > DECODE_CHUNK_TOKENS and on_host(device) and not variants:
            groups.append(make_chunked_decode(decodes, metadata, device))
        else:
            groups.append(_padded_group(decodes, metadata, device))
    for members in _pack(prefills, q_lens, seq_lens):
        i = members[0]
        if len(members) == 1 and q_lens[i] == seq_lens[i]:
            start = metadata.query_start_loc[i]
            groups.append(SDPAGroup(max_q=q_lens[i], fresh=(start, start + q_lens[i])))
        else:
            groups.append(_padded_group(members, metadata, device))
    first = groups[0]
    if isinstance(first, CppDecode):
        identity = len(groups) == 1 and len(decodes) == total
    else:
        identity = len(groups) == 1 and not isinstance(first, ChunkedDecode) and (
            first.fresh == (0, total) or (first.ordered and first.num_rows == total))
    return StepPlan(groups, identity, cpp, all_decodes=not prefills)


def _cpp_decode(decodes: list[int], meta: AttentionMetadata, kv_heads: int) -> CppDecode:
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
    return CppDecode(rows=rows, tables=tables.contiguous(), lens=torch.tensor(lens),
                      split=split)


def _cpp_rows(meta: AttentionMetadata, kv_heads: int) -> CppDecode:
    """Every token of the step as one row of ``decode_attention.cpp``: token t of a request
    with ``ctx`` cached positions attends keys ``[0, ctx + t + 1)`` of its table, read in place
    after ``kv_write`` wrote the step's K/V. The causal mask is each row's length."""
    qsl, total = meta.query_start_loc, meta.query_start_loc[-1]
    req_of = torch.repeat_interleave(torch.arange(len(meta.seq_lens)),
                                     torch.tensor(meta.query_lens))  # [T]
    # row t of request i: seq_lens[i] keys at its last row (qsl[i + 1] - 1), one fewer a row up
    last_len = torch.tensor(meta.seq_lens) - torch.tensor(qsl[1:])
    lens = last_len[req_of] + torch.arange(1, total + 1)
    tables = meta.block_tables[req_of].contiguous()
    split = layer_ops.decode_split([], kv_heads, meta.block_size, torch.get_num_threads())
    return CppDecode(rows=torch.arange(total), tables=tables, lens=lens, split=split)


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


def _padded_group(members: list[int], meta: AttentionMetadata, device: torch.device) -> SDPAGroup:
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
    group = SDPAGroup(max_q=Q, token_rows=token_rows.to(device), blocks=blocks.to(device),
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
