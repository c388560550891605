"""A request's last token and its drafts as decode query rows of their own (the layout the
runner gives a verification step) attend exactly as the same tokens as one causal query
(the chunked-prefill path): on torch_paged (the C++ decode kernel on the CPU) and on the
FlashInfer backend (through the CPU stand-in, ``runtime/flashinfer_standin.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.executor.attention.base import AttentionMetadata
from tests.executor.test_flashinfer import BLOCK, backends


@pytest.mark.parametrize("ctx,drafts", [(13, 4), (3, 8), (16, 1)])
def test_draft_rows_attend_like_one_causal_query(ctx, drafts):
    heads, kv_heads, dim = 4, 2, 16
    m = drafts + 1
    gen = torch.Generator().manual_seed(ctx)
    num_blocks = (ctx + m) // BLOCK + 4
    fib, ref, cache = backends(heads, kv_heads, dim, num_blocks)
    table = list(range(num_blocks - 1, 0, -1))[:-(-(ctx + m) // BLOCK)]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx + m)]
    flat = cache.view(2, -1, kv_heads, dim)
    flat[:, slots[:ctx]] = torch.randn(2, ctx, kv_heads, dim, generator=gen)
    q = torch.randn(m, heads, dim, generator=gen)
    k = torch.randn(m, kv_heads, dim, generator=gen)
    v = torch.randn(m, kv_heads, dim, generator=gen)
    one = np.array([table], dtype=np.int64)
    rows = np.repeat(one, m, axis=0)

    def meta(qsl, seq_lens, tables) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens,
                                 block_tables=torch.from_numpy(tables),
                                 slot_mapping=torch.tensor(slots[ctx:]), block_size=BLOCK,
                                 block_tables_host=tables)

    causal = meta([0, m], [ctx + m], one)
    ref.prepare(causal)
    expected = ref.forward(q, k, v, cache.clone(), causal, dim**-0.5)
    for backend in (ref, fib):
        as_rows = meta(list(range(m + 1)), list(range(ctx + 1, ctx + m + 1)), rows)
        backend.prepare(as_rows)
        if backend is fib:
            fib.plan(as_rows)
        got = backend.forward(q, k, v, cache.clone() if backend is ref else cache, as_rows,
                              dim**-0.5)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fib.decode.num_plans == 1 and fib.prefill.num_plans == 0  # the decode wrapper
