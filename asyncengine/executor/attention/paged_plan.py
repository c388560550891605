"""FlashInfer's paged-KV arrays from a step's block tables and lengths, with numpy.

FlashInfer describes a batch over a paged KV cache with four integer arrays:

* ``qo_indptr`` ``[B + 1]``: request ``i``'s query tokens are rows ``qo_indptr[i]:qo_indptr[i+1]``
  of the flattened step (the runner's ``query_start_loc``);
* ``kv_indptr`` ``[B + 1]``: its pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``;
* ``kv_indices`` ``[nnz]``: page (= KV block) ids, request after request;
* ``kv_last_page_len`` ``[B]``: tokens used in its last page, in ``[1, page_size]``.

Request ``i`` then holds ``(pages - 1) * page_size + last_page_len = seq_lens[i]`` tokens, its
token ``p`` in slot ``kv_indices[kv_indptr[i] + p // page_size] * page_size + p % page_size`` --
exactly the slot the runner's ``slot_mapping`` writes it to, so prefill, chunked prefill (a
later chunk: query shorter than the sequence) and prefix hits (cached blocks at the front of
the table) need nothing special. FlashInfer's causal mask aligns the ``q`` query rows with the
*last* ``q`` keys, as the runner's metadata means them.

Everything is vectorized: no Python loop over requests or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PagedKVPlan:
    qo_indptr: np.ndarray  # [B + 1] int32
    kv_indptr: np.ndarray  # [B + 1] int32
    kv_indices: np.ndarray  # [nnz] int32
    kv_last_page_len: np.ndarray  # [B] int32

    @property
    def num_reqs(self) -> int:
        return len(self.kv_last_page_len)

    @property
    def decode_only(self) -> bool:
        """Every request has exactly one query token (``qo_indptr`` is 0, 1, 2, ...)."""
        q = self.qo_indptr
        return int(q[-1]) == len(q) - 1  # (indptr never decreases, and no request is empty)


def plan_paged_kv(block_tables: np.ndarray, seq_lens: np.ndarray | list[int],
                  query_start_loc: np.ndarray | list[int], page_size: int) -> PagedKVPlan:
    """The arrays for a step whose request ``i`` has ``seq_lens[i]`` tokens in the pages of
    ``block_tables[i]`` (``[B, W]``, entries past its pages ignored) and its query tokens at
    ``query_start_loc[i]:query_start_loc[i+1]``."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    if len(qsl) != len(seq) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries for {len(seq)} requests")
    if len(seq) and (seq < 1).any():
        raise ValueError("every request needs at least one token in the KV cache")
    pages = (seq + page_size - 1) // page_size
    tables = np.asarray(block_tables)
    if len(seq) and pages.max() > tables.shape[1]:
        raise ValueError(f"a request needs {int(pages.max())} pages, its block table has "
                         f"{tables.shape[1]}")
    kv_indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    used = np.arange(tables.shape[1])[None, :] < pages[:, None]  # [B, W]
    kv_indices = tables[:len(seq)][used].astype(np.int32)  # row-major: request after request
    last = (seq - (pages - 1) * page_size).astype(np.int32)
    return PagedKVPlan(qo_indptr=qsl.astype(np.int32), kv_indptr=kv_indptr,
                       kv_indices=kv_indices, kv_last_page_len=last)


def pad_decode_plan(plan: PagedKVPlan, batch: int, scratch_page: int) -> PagedKVPlan:
    """``plan`` (a pure decode) padded to ``batch`` requests for a CUDA graph: each padding
    request has one query token and one page, the scratch page, holding that one token (its
    own K/V, written there through the padded slot mapping)."""
    n = plan.num_reqs
    if batch < n:
        raise ValueError(f"cannot pad {n} requests down to {batch}")
    pad = batch - n
    if pad == 0:
        return plan
    if not plan.decode_only:
        raise ValueError("only a pure-decode step is padded for a CUDA graph")
    tail = plan.kv_indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)
    return PagedKVPlan(
        qo_indptr=np.arange(batch + 1, dtype=np.int32),
        kv_indptr=np.concatenate([plan.kv_indptr, tail]).astype(np.int32),
        kv_indices=np.concatenate([plan.kv_indices,
                                   np.full(pad, scratch_page, dtype=np.int32)]),
        kv_last_page_len=np.concatenate([plan.kv_last_page_len,
                                         np.ones(pad, dtype=np.int32)]),
    )
