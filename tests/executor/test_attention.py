"""torch_paged attention vs a naive per-request reference over the requests' full histories."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncengine.executor.attention import (
    decode_chunks,
    get_attention_backend,
    torch_paged,
    torch_paged_plan,
)
from asyncengine.executor.attention.base import AttentionMetadata
from asyncengine.executor.attention.decode_chunks import ChunkedDecode
from asyncengine.executor.attention.torch_paged import TorchPagedBackend
from asyncengine.executor.kernels import layer_ops

BLOCK = 4

HAS_KERNEL = layer_ops.ENABLED and layer_ops._kernels(torch.float32) is not None


@pytest.fixture(params=["kernel", "sdpa"])
def path(request, monkeypatch):
    """Both CPU decode paths: the own C++ kernel (cache read in place) and SDPA's groups."""
    if request.param == "kernel" and not HAS_KERNEL:
        pytest.skip("the CPU layer kernels do not build here")
    if request.param == "sdpa":
        monkeypatch.setattr(layer_ops, "ENABLED", False)
    return request.param


@pytest.fixture
def sdpa(monkeypatch):
    """The SDPA groups only (tests of their structure)."""
    monkeypatch.setattr(layer_ops, "ENABLED", False)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """q [Q, H, D] = the last Q positions of k, v [L, KV, D]; causal, in float64."""
    Q, H, D = q.shape
    L, KV, _ = k.shape
    group = H // KV
    out = torch.empty(Q, H, D, dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for t in range(Q):
            n = L - Q + t + 1  # keys visible to the query at position L - Q + t
            w = torch.softmax(q[t, h].double() @ kh[:n].T * scale, dim=-1)
            out[t, h] = w @ vh[:n]
    return out


def run_step(cases: list[tuple[int, int]], heads: int, kv_heads: int, dtype=torch.float32,
             head_dim: int = 16, seed: int = 0):
    """cases: (context already cached, query_len) per request, in batch order.

    Returns (output, reference, metadata, kv_cache, histories).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = sum(math.ceil((c + n) / BLOCK) for c, n in cases)
    num_blocks = blocks_needed + 3
    pool = list(range(1, num_blocks))
    rng.shuffle(pool)  # block tables point all over the cache
    backend = TorchPagedBackend()
    (kv_cache,) = backend.allocate_kv_cache(1, num_blocks, BLOCK, kv_heads, head_dim, dtype, "cpu")
    qs, ks, vs, slots, tables, seq_lens, starts, hist = [], [], [], [], [], [], [0], []
    for ctx, n in cases:
        L = ctx + n
        table = [pool.pop() for _ in range(math.ceil(L / BLOCK))]
        k = torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(L, kv_heads, head_dim, generator=gen).to(dtype)
        slot = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(L)]
        flat = kv_cache.view(2, -1, kv_heads, head_dim)
        flat[0, slot[:ctx]], flat[1, slot[:ctx]] = k[:ctx], v[:ctx]  # the cached prefix
        qs.append(torch.randn(n, heads, head_dim, generator=gen).to(dtype))
        ks.append(k[ctx:])
        vs.append(v[ctx:])
        slots += slot[ctx:]
        tables.append(table)
        seq_lens.append(L)
        starts.append(starts[-1] + n)
        hist.append((k, v, slot))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=seq_lens, block_tables=padded,
                             slot_mapping=torch.tensor(slots), block_size=BLOCK)
    backend.prepare(meta)
    scale = head_dim**-0.5
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    out = backend.forward(q, k, v, kv_cache, meta, scale)
    ref = torch.cat([naive_attention(qi, hk, hv, scale)
                     for qi, (hk, hv, _) in zip(qs, hist, strict=True)])
    return out, ref, meta, kv_cache, hist


MIXED = [(36, 1), (0, 9), (20, 7), (4, 1), (16, 13), (15, 1), (0, 1), (3, 2)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_mixed_batch_matches_reference(heads, kv_heads, path):
    # decodes (one at a block boundary, one with no context), a fresh prompt, a chunk on top
    # of earlier chunks, a prompt after a cached prefix, a 2-token chunk — interleaved.
    out, ref, meta, kv_cache, hist = run_step(MIXED, heads, kv_heads)
    assert out.shape == (sum(n for _, n in MIXED), heads, 16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # every token's K/V is in the cache at its slot afterwards
    flat = kv_cache.view(2, -1, kv_heads, 16)
    for k, v, slot in hist:
        torch.testing.assert_close(flat[0, slot], k)
        torch.testing.assert_close(flat[1, slot], v)


def test_pure_decode_batch_is_one_group(path):
    cases = [(c, 1) for c in (0, 3, 4, 17, 40, 63, 5, 8)]
    out, ref, meta, _, _ = run_step(cases, 6, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(meta.extra.groups) == 1  # one SDPA call per layer for all decodes


def test_decodes_first_then_prefills(sdpa):
    # the decode group is a plain slice of the step's rows (no gather of queries)
    cases = [(10, 1), (20, 1), (3, 1), (0, 5), (8, 6)]
    out, ref, meta, _, _ = run_step(cases, 4, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert meta.extra.groups[0].ordered


def test_single_fresh_prompt(path):
    out, ref, meta, _, _ = run_step([(0, 50)], 4, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_prefills_of_very_different_lengths_are_split_into_groups(sdpa):
    cases = [(0, 300), (8, 2), (0, 3), (100, 120), (5, 7), (36, 1), (0, 64), (1, 1)]
    out, ref, meta, _, _ = run_step(cases, 4, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(meta.extra.groups) >= 3  # decodes + small prefills + the long ones apart


def test_bfloat16_close_to_reference(path):
    out, ref, _, _, _ = run_step(MIXED, 4, 2, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


LONG = [(1500, 1), (3, 1), (700, 1), (511, 1), (512, 1), (0, 1), (1023, 1), (20, 5), (100, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_long_decodes_are_read_in_chunks_and_match_reference(heads, kv_heads, sdpa):
    # contexts past DECODE_CHUNK_TOKENS (many 4-token blocks, chunk edges hit exactly),
    # short ones that stop after the first chunk, a decode with no context, and a prefill
    out, ref, meta, _, _ = run_step(LONG, heads, kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    chunked = [g for g in meta.extra.groups if isinstance(g, ChunkedDecode)]
    assert len(chunked) == 1
    sizes = [c.rows for c in chunked[0].chunks]
    assert sizes[0] == 8 and sizes[-1] == 1  # every decode, then only the longest
    assert sizes == sorted(sizes, reverse=True)


def test_chunked_decode_with_tiny_chunks(monkeypatch, sdpa):
    # one block per chunk: dozens of merges, each row leaving at its own chunk
    monkeypatch.setattr(torch_paged_plan, "DECODE_CHUNK_TOKENS", 4)
    monkeypatch.setattr(decode_chunks, "DECODE_CHUNK_TOKENS", 4)
    cases = [(c, 1) for c in (0, 3, 4, 17, 40, 63, 5, 8)] + [(6, 3)]
    out, ref, meta, _, _ = run_step(cases, 6, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(meta.extra.groups[0].chunks) == 16


def test_chunked_decode_bfloat16_close_to_reference(sdpa):
    out, ref, _, _, _ = run_step(LONG, 4, 2, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_get_attention_backend_on_cpu():
    assert isinstance(get_attention_backend("auto", "cpu"), TorchPagedBackend)
    assert isinstance(get_attention_backend("torch_paged"), TorchPagedBackend)


kernel_only = pytest.mark.skipif(not HAS_KERNEL, reason="the CPU layer kernels do not build here")


@kernel_only
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_decode_kernel_reads_the_cache_in_place(heads, kv_heads, monkeypatch):
    # no gather copy and no SDPA for the decodes: one kernel call reads the blocks in place
    def no_copy(*args, **kwargs):
        raise AssertionError("decodes gathered their KV history")

    monkeypatch.setattr(torch_paged, "_gather", no_copy)
    monkeypatch.setattr(torch_paged, "chunked_decode", no_copy)
    cases = [(c, 1) for c in (0, 3, 4, 17, 40, 63, 5, 8, 1500, 700)]
    out, ref, meta, _, _ = run_step(cases, heads, kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert [type(g).__name__ for g in meta.extra.groups] == ["CppDecode"]


@kernel_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tokens_are_rows_of_the_in_place_kernel(dtype, monkeypatch):
    # fresh prompts, chunks after a cached context and decodes in one step: every token is a
    # row of decode_attention.cpp (its length its causal limit), read in place, no SDPA
    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prefill took SDPA")

    monkeypatch.setattr(torch_paged, "_gather", no_sdpa)
    monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", no_sdpa)
    cases = [(0, 300), (8, 2), (0, 3), (100, 120), (5, 7), (36, 1), (0, 64), (1, 1)]
    out, ref, meta, _, _ = run_step(cases, 8, 2, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    plan = meta.extra
    assert [type(g).__name__ for g in plan.groups] == ["CppDecode"] and plan.identity
    assert not plan.all_decodes  # the decode stack runs all-decode steps only
    assert plan.groups[0].lens.tolist()[:3] == [1, 2, 3]  # the fresh prompt's first rows


@kernel_only
def test_a_chunk_past_the_rows_table_limit_takes_sdpa(monkeypatch):
    monkeypatch.setattr(torch_paged_plan, "ROWS_TABLE_MAX", 64)
    out, ref, meta, _, _ = run_step([(0, 100), (20, 1)], 4, 2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert "SDPAGroup" in [type(g).__name__ for g in meta.extra.groups]


@kernel_only
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (9, 3, 64), (8, 2, 80),
                                                    (6, 6, 128), (4, 1, 24), (5, 5, 272)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_head_sizes(heads, kv_heads, head_dim, dtype):
    # real head sizes and query groups: 64 (7 and 3 query heads per KV head), 80 and 128
    # take the AVX-512 path (16 keys a step, each key and value row widened once for the
    # group), 24 and 272 the 8-wide one; every tail of a 16-key step is covered
    cases = [(c, 1) for c in (0, 1, 15, 16, 17, 31, 40, 100)]
    out, ref, meta, _, _ = run_step(cases, heads, kv_heads, dtype=dtype, head_dim=head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert [type(g).__name__ for g in meta.extra.groups] == ["CppDecode"]


@kernel_only
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_splits_long_contexts_and_merges_exactly(threads, monkeypatch):
    # few requests with long contexts: each is split into spans of positions that run on
    # different threads, and the spans' partial softmaxes are merged (flash-decoding)
    monkeypatch.setattr(layer_ops, "MIN_SPLIT", 8)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, ref, meta, _, _ = run_step([(1500, 1), (300, 1), (20, 5), (0, 1)], 8, 1)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    group = meta.extra.groups[0]
    longest = max(group.lens.tolist())
    # the longest request was split
    assert layer_ops.split_of(group.split, longest, 1, BLOCK) < longest


@kernel_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx,rows,cap", [(200, 9, None), (17, 3, None), (95, 95, None),
                                          (130, 5, 30.0), (300, 9, None)])
def test_rows_sharing_blocks_attend_together_each_as_alone(dtype, ctx, rows, cap):
    # a verification's rows (or a prefill's tokens): one table, lengths one apart, attended
    # together (attention_rows.h), each row's output the bits it gets alone (a plain decode
    # step's): greedy output is the same with and without speculation. 300: long rows are
    # split into spans and take the per-row path
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(ctx + rows)
    nb = (ctx + bs) // bs + 2
    kv = torch.randn(2, nb + 4, bs, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(nb + 4, generator=gen)[:nb]
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    tables = table[None].expand(rows, nb).contiguous()
    lens = torch.arange(ctx - rows + 1, ctx + 1)
    idx = torch.arange(rows)
    split = layer_ops.decode_split([], kv_heads, bs, 2)
    together = layer_ops.decode_attention(q, kv, tables, lens, idx, split, dim**-0.5, None, cap)
    alone = torch.cat([layer_ops.decode_attention(q, kv, tables[i:i + 1], lens[i:i + 1],
                                                  idx[i:i + 1], split, dim**-0.5, None, cap)
                       for i in range(rows)])
    assert torch.equal(together, alone)
