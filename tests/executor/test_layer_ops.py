"""The CPU layer kernels (executor/kernels/layer_ops.py) against their PyTorch counterparts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.models.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(
    not layer_ops.ENABLED or layer_ops._kernels(torch.float32) is None,
    reason="the CPU layer kernels do not build here")

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: the same arithmetic up to summation order; bfloat16: the kernels round once
    # where PyTorch rounds after every op, so they differ by an ulp or two of bfloat16
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_with_and_without_residual(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    res = torch.randn(rows, 200, generator=gen).to(dtype)
    w = torch.randn(200, generator=gen).to(dtype)

    def ref(y):
        return w * F.rms_norm(y.float(), (200,), eps=1e-6).to(dtype)

    _close(layer_ops.rms_norm(x, w, 1e-6), ref(x), dtype)
    out, new_res = layer_ops.rms_norm(x, w, 1e-6, res.clone())
    assert torch.equal(new_res, x + res)  # the residual add, rounded as PyTorch rounds it
    _close(out, ref(x + res), dtype)
    # strided rows (a slice of a wider tensor) read correctly
    wide = torch.randn(rows, 300, generator=gen).to(dtype)
    _close(layer_ops.rms_norm(wide[:, 50:250], w, 1e-6), ref(wide[:, 50:250]), dtype)


def test_bfloat16_rounding_eight_at_a_time_is_round_to_nearest_even():
    """The kernels round eight floats to bfloat16 at a time (common.h: ae_bf16_round8): the
    residual add of rms_norm, rounded so, is PyTorch's bfloat16 add to the bit: ties to even,
    overflow to infinity, subnormals kept, infinities and NaNs through."""
    tie = 2.0 ** -8  # half a bfloat16 ulp at 1
    pairs = [(1.0, tie), (1 + 2 ** -7, tie), (-1.0, -tie), (3.0, 3 * tie), (1.0, tie / 2),
             (3.3e38, 3.3e38), (-3.3e38, -3.3e38), (1e-39, 1e-40), (-1e-39, 2e-39),
             (float("inf"), 1.0), (-float("inf"), 5.0), (float("nan"), 1.0), (0.0, -0.0),
             (-0.0, -0.0), (65504.0, 8.0), (2.0 ** -126, -(2.0 ** -127))]
    n = 64  # eight vectors of eight
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(9))
    r = torch.randn(2, n, generator=torch.Generator().manual_seed(10)) * 1e-3
    for i, (a, b) in enumerate(pairs):
        x.view(-1)[i], r.view(-1)[i] = a, b
    x, r = x.to(torch.bfloat16), r.to(torch.bfloat16)
    _, new_res = layer_ops.rms_norm(x, torch.ones(n, dtype=torch.bfloat16), 1e-6, r.clone())
    expected = x + r
    finite = ~expected.isnan()
    assert torch.equal(new_res[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert torch.equal(new_res.isnan(), expected.isnan())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_silu_mul(dtype, rows):
    gu = torch.randn(rows, 2 * 72, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    gate, up = gu.chunk(2, dim=-1)
    _close(layer_ops.silu_mul(gu), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_in_place_on_the_q_and_k_heads_of_a_fused_row(dtype, head_dim):
    rot = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0, rope_scaling=None), head_dim)
    positions = torch.tensor([0, 1, 17, 100, 4095])
    cos, sin = rot(positions, dtype)
    qkv = torch.randn(5, 7 * head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    qk = qkv.view(5, 7, head_dim)[:, :5]  # 3 q heads + 2 k heads; 2 v heads untouched
    expected = apply_rope(qk, cos, sin)
    before_v = qkv.view(5, 7, head_dim)[:, 5:].clone()
    out = layer_ops.rope_(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    _close(qkv.view(5, 7, head_dim)[:, :5], expected, dtype)
    assert torch.equal(qkv.view(5, 7, head_dim)[:, 5:], before_v)


def test_kv_write_puts_rows_in_their_slots_and_skips_negative_ones():
    kv = torch.zeros(2, 6, 4, 2, 8)
    rows = torch.randn(3, 6 * 8)  # a fused qkv row: 2 q heads, 2 k heads, 2 v heads
    k, v = rows[:, 16:32].view(3, 2, 8), rows[:, 32:].view(3, 2, 8)
    layer_ops.kv_write(k, v, kv, torch.tensor([5, -1, 23]))
    flat = kv.view(2, 24, 2, 8)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 23], v[2])
    assert int((flat != 0).any(-1).any(-1).sum()) == 4  # two slots in K, two in V


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_softmax_over_the_gathered_history(dtype):
    gen = torch.Generator().manual_seed(3)
    blocks, bs, kv_heads, dim, heads = 40, 16, 2, 32, 6
    kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    lens = [1, 16, 17, 250, 600]
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:38] for _ in lens])
    q = torch.randn(len(lens) + 1, heads, dim, generator=gen).to(dtype)
    rows = torch.tensor([5, 0, 2, 1, 3])
    for split in (16, 48, 1024):  # spans merged across items, and whole requests
        out = layer_ops.decode_attention(q, kv, tables, torch.tensor(lens), rows, split, 0.2)
        for b, n in enumerate(lens):
            blk = tables[b, :(n + bs - 1) // bs]
            k = kv[0][blk].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(3, 1)
            v = kv[1][blk].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(3, 1)
            scores = torch.einsum("hd,lhd->hl", q[rows[b]].double(), k) * 0.2
            ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
            _close(out[b], ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_of_a_row_does_not_depend_on_the_batch(dtype, threads):
    """Under ``decode_split``'s per-request rule a row's result is the same, to the bit, alone
    in a step and beside others: a verification's rows (one sequence at consecutive lengths)
    are computed as the one-token steps at their positions compute them."""
    gen = torch.Generator().manual_seed(4)
    blocks, bs, kv_heads, dim, heads = 64, 16, 3, 64, 9
    kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)[:60]
    lens = [700 + i for i in range(9)] + [30, 900]  # 9 draft rows of one sequence, 2 others
    tables = torch.stack([table] * 9 + [torch.randperm(blocks, generator=gen)[:60]
                                        for _ in range(2)])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    rows = torch.arange(len(lens))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = layer_ops.decode_split(lens, kv_heads, bs, threads)
        batch = layer_ops.decode_attention(q, kv, tables, torch.tensor(lens), rows, split, 0.125)
        for b in (0, 4, 8, 9, 10):
            alone = layer_ops.decode_attention(
                q, kv, tables[b:b + 1], torch.tensor(lens[b:b + 1]), rows[b:b + 1],
                layer_ops.decode_split(lens[b:b + 1], kv_heads, bs, threads), 0.125)
            assert torch.equal(batch[b], alone[0])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim,window,cap", [(64, None, None), (64, 200, 30.0), (24, None, None)])
def test_verification_rows_are_each_the_row_alone(dtype, threads, dim, window, cap):
    """Verification-shaped batches: two requests' 1 + k rows (one sequence each, consecutive
    lengths, the same block table) across the boundaries where the spans and the key groups
    are cut (128-key groups, the 256-position least span, a 384-position span), beside plain
    decodes. Every row's result is, to the bit, the one-row step's at its length."""
    gen = torch.Generator().manual_seed(5)
    blocks, bs, kv_heads, heads = 96, 16, 3, 9
    kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    first = {120: 17, 250: 13, 380: 9}
    for start, rows_of_one in first.items():
        lens = [start + i for i in range(rows_of_one)]
        lens = [40] + lens + [start + 3 + i for i in range(5)] + [700]
        own = [torch.randperm(blocks, generator=gen)[:48] for _ in range(4)]
        tables = torch.stack([own[0]] + [own[1]] * rows_of_one + [own[2]] * 5 + [own[3]])
        q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            batch = _attend_rows(q, kv, tables, lens, list(range(len(lens))), window, cap)
            for b in range(len(lens)):
                alone = _attend_rows(q, kv, tables, lens, [b], window, cap)
                assert torch.equal(batch[b], alone[0]), (start, b)
        finally:
            torch.set_num_threads(previous)


def _attend_rows(q, kv, tables, lens, sel, window, cap):
    """decode_attention of the rows ``sel`` (q's rows, tables' rows, lens) as one step."""
    split = layer_ops.decode_split([lens[i] for i in sel], kv.shape[3], kv.shape[2],
                                   torch.get_num_threads())
    return layer_ops.decode_attention(q, kv, tables[sel].contiguous(),
                                      torch.tensor([lens[i] for i in sel]), torch.tensor(sel),
                                      split, 0.125, window, cap)


def test_decode_split_spreads_a_long_request_over_the_threads_whatever_the_batch():
    # per request: spans of at least MIN_SPLIT positions so that it alone keeps the threads
    # busy; the whole request where its KV heads do; never more than its positions
    split = layer_ops.decode_split([100] * 64, 2, 16, 2)
    assert split == layer_ops.decode_split([4000], 2, 16, 2)  # the batch does not matter
    span = layer_ops.split_of(split, 4000, 2, 16)
    assert span % 16 == 0 and layer_ops.MIN_SPLIT <= span < 4000
    assert layer_ops.split_of(split, 100, 2, 16) == 112  # a short one: whole
    assert layer_ops.split_of(split, 1000, 2, 16) == 512  # 2 x 2 spans: 1000 * 2 / 4, rounded
    assert layer_ops.split_of(split, 4000, 8, 16) == 4000  # 8 KV heads keep 2 threads busy
    assert layer_ops.split_of(64, 4000, 2, 16) == 64  # a positive split: as given


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_model_forward_agrees_with_the_pytorch_path(family, monkeypatch):
    # a tiny model, eager on the CPU: a prefill and three decodes, kernels on and off
    # (qwen3: per-head q/k norms, then RoPE by the kernel on the normed heads)
    from asyncengine.executor.attention.base import AttentionMetadata
    from asyncengine.executor.attention.torch_paged import TorchPagedBackend
    from asyncengine.executor.models.llama import LlamaForCausalLM
    from tests.utils import tiny_config

    torch.manual_seed(0)
    config = tiny_config(family)
    model = LlamaForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    backend = TorchPagedBackend()

    def run(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layer_ops, "ENABLED", enabled)
        caches = backend.allocate_kv_cache(config.num_hidden_layers, 8, 4, model.num_kv_heads,
                                           model.head_dim, torch.float32, "cpu")
        table = torch.tensor([[3, 1, 6, 2]])
        outs = []
        ids, positions = torch.tensor([5, 9, 2, 7, 1, 3]), torch.arange(6)
        for step in range(4):
            n = ids.shape[0]
            slots = table[0, positions // 4] * 4 + positions % 4
            meta = AttentionMetadata(query_start_loc=[0, n], seq_lens=[int(positions[-1]) + 1],
                                     block_tables=table, slot_mapping=slots, block_size=4)
            backend.prepare(meta)
            with torch.inference_mode():
                h = model(ids, positions, caches, meta, backend)
            outs.append(h)
            ids = torch.tensor([10 + step])
            positions = positions[-1:] + 1
        return outs

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
