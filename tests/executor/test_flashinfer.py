"""The FlashInfer path on the CPU: planning from the persistent batch (against hand-computed
arrays and against the runner's slot mapping), the backend's plan/run wiring through a
stand-in module (``runtime/flashinfer_standin.py``) against torch_paged, and the routing of
sampling to FlashInfer's kernels. The real kernels run only in ``test_gpu.py``."""

from __future__ import annotations

import math
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.fcfs import FCFSScheduler
from asyncengine.core.sched.interface import ModelRunnerOutput
from asyncengine.executor.attention.base import PLAIN, AttentionMetadata, AttentionOptions
from asyncengine.executor.attention.flashinfer import FlashInferBackend
from asyncengine.executor.attention.paged_plan import PagedKVPlan, pad_decode_plan, plan_paged_kv
from asyncengine.executor.attention.torch_paged import TorchPagedBackend
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.runtime.flashinfer_standin import make_module
from asyncengine.executor.sampler import NO_TOKEN, SamplingBatch, sample_ids
from asyncengine.executor.sampler.flashinfer_sampling import unsupported_reason


def token_slots(plan: PagedKVPlan, page_size: int) -> list[list[int]]:
    """Each request's slots, position by position, as the plan tells the kernels."""
    out = []
    for i in range(plan.num_reqs):
        pages = plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]].tolist()
        length = (len(pages) - 1) * page_size + int(plan.kv_last_page_len[i])
        out.append([pages[p // page_size] * page_size + p % page_size for p in range(length)])
    return out


def test_plan_by_hand():
    """A decode (9 tokens in the cache), a fresh prompt of 6, and a prefix hit whose second
    chunk of 2 tokens follows 8 cached ones; block size 4, stale table entries 99."""
    tables = np.array([[7, 2, 5], [1, 3, 99], [4, 6, 8]])
    plan = plan_paged_kv(tables, [9, 6, 10], [0, 1, 7, 9], 4)
    assert plan.qo_indptr.tolist() == [0, 1, 7, 9]
    assert plan.kv_indptr.tolist() == [0, 3, 5, 8]
    assert plan.kv_indices.tolist() == [7, 2, 5, 1, 3, 4, 6, 8]
    assert plan.kv_last_page_len.tolist() == [1, 2, 2]
    assert all(a.dtype == np.int32 for a in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                              plan.kv_last_page_len))
    assert not plan.decode_only
    full = plan_paged_kv(np.array([[3, 9]]), [8], [0, 1], 4)  # a full last page: 4, not 0
    assert full.kv_last_page_len.tolist() == [4] and full.decode_only


def test_plan_rejects_inconsistent_inputs():
    with pytest.raises(ValueError, match="pages"):
        plan_paged_kv(np.array([[1]]), [5], [0, 1], 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        plan_paged_kv(np.array([[1]]), [3], [0], 4)


def test_pad_decode_plan_for_a_cuda_graph():
    plan = plan_paged_kv(np.array([[7, 2, 5], [1, 3, 0]]), [9, 6], [0, 1, 2], 4)
    padded = pad_decode_plan(plan, 4, scratch_page=50)
    assert padded.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert padded.kv_indptr.tolist() == [0, 3, 5, 6, 7]
    assert padded.kv_indices.tolist() == [7, 2, 5, 1, 3, 50, 50]
    assert padded.kv_last_page_len.tolist() == [1, 2, 1, 1]
    assert pad_decode_plan(plan, 2, 50) is plan
    with pytest.raises(ValueError):
        pad_decode_plan(plan, 1, 50)
    mixed = plan_paged_kv(np.array([[1, 2]]), [6], [0, 3], 4)
    with pytest.raises(ValueError, match="pure-decode"):
        pad_decode_plan(mixed, 2, 50)


def test_planned_pages_hold_exactly_the_slots_the_runner_writes():
    """The real scheduler drives the persistent batch through prefix hits, chunked prefill
    (budget 16 tokens), decodes and mixed steps. At every step the plan built from the batch's
    block tables gives each request exactly seq_len tokens, and its query tokens sit in the
    slots the runner's slot mapping writes their K/V to."""
    bs = 4
    config = EngineConfig.from_dict({"max_num_seqs": 4, "max_num_batched_tokens": 16,
                                     "block_size": bs, "max_model_len": 128})
    scheduler = FCFSScheduler(config, 64)
    fi, _ = make_module()
    backend = FlashInferBackend(4, 2, 8, bs, torch.float32, "cpu", max_pages_per_seq=33,
                                module=fi, workspace_bytes=64)
    runner = ModelRunner(SimpleNamespace(vocab_size=500), backend, [], bs, torch.device("cpu"),
                         frozenset(), max_num_seqs=4, max_model_len=128)
    shared = list(range(100, 124))  # a 24-token prefix (6 blocks) that later requests hit
    prompts = [shared + [1, 2, 3], list(range(200, 237)), shared + [4, 5], [7, 8, 9],
               shared + [6] * 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seen = set()
    for step in range(60):
        if step % 4 == 0 and prompts:
            p = prompts.pop(0)
            scheduler.add_request(Request(f"r{step}", p, params, max_model_len=128))
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        inputs = runner.prepare(out)
        meta = inputs.attn_metadata
        plan = meta.extra.plan
        assert plan.qo_indptr.tolist() == meta.query_start_loc
        slots = meta.slot_mapping.tolist()
        for i, (s, want) in enumerate(zip(out.scheduled, token_slots(plan, bs), strict=True)):
            assert len(want) == meta.seq_lens[i] == s.start + s.num_new_tokens
            q0, q1 = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            assert slots[q0:q1] == want[s.start:]
            if s.num_new_tokens == 1:
                seen.add("decode")
            elif s.start > 0 and s.start + s.num_new_tokens < len(s.request.prompt_token_ids):
                seen.add("middle chunk")
            elif s.start > 0:
                seen.add("prefix hit or last chunk")
        if plan.decode_only and len(out.scheduled) > 1:
            seen.add("decode batch")
        elif len(out.scheduled) > 1:
            seen.add("mixed batch")
        scheduler.update_from_output(out, ModelRunnerOutput(
            sampled_token_ids={s.request.request_id: 42 for s in out.scheduled if s.samples}))
    assert seen == {"decode", "middle chunk", "prefix hit or last chunk", "decode batch",
                    "mixed batch"}
    assert scheduler.make_stats().prefix_cache_hits > 0


# -- the backend through the stand-in module, against torch_paged --------------------------------

BLOCK = 4
MIXED = [(36, 1), (0, 9), (20, 7), (4, 1), (16, 13), (15, 1), (0, 1), (3, 2)]
DECODES = [(36, 1), (4, 1), (15, 1), (0, 1), (7, 1)]


def backends(heads: int, kv_heads: int, dim: int, num_blocks: int):
    fi, _ = make_module()
    fib = FlashInferBackend(heads, kv_heads, dim, BLOCK, torch.float32, "cpu",
                            max_pages_per_seq=16, module=fi, workspace_bytes=64)
    caches = fib.allocate_kv_cache(1, num_blocks, BLOCK, kv_heads, dim, torch.float32, "cpu")
    fib.bind_kv_cache(caches)
    return fib, TorchPagedBackend(), caches[0]


def step(cases, heads=4, kv_heads=2, dim=16, padded_batch=None, seed=0,
         options: AttentionOptions = PLAIN, scale: float | None = None):
    """Both backends attend the same step over the same cache (a layer of variant ``options``
    with attention ``scale``); returns their outputs and the flashinfer backend."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(math.ceil((c + n) / BLOCK) for c, n in cases) + 2
    fib, ref, cache = backends(heads, kv_heads, dim, num_blocks)
    if options != PLAIN:  # a model with both kinds of layers
        fib.configure_layers([PLAIN, options, PLAIN])
        ref.configure_layers([PLAIN, options, PLAIN])
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    qs, ks, vs, slots, tables, seq_lens, starts = [], [], [], [], [], [], [0]
    flat = cache.view(2, -1, kv_heads, dim)
    for ctx, n in cases:
        table = [pool.pop() for _ in range(math.ceil((ctx + n) / BLOCK))]
        slot = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx + n)]
        flat[:, slot[:ctx]] = torch.randn(2, ctx, kv_heads, dim, generator=gen)
        qs.append(torch.randn(n, heads, dim, generator=gen))
        ks.append(torch.randn(n, kv_heads, dim, generator=gen))
        vs.append(torch.randn(n, kv_heads, dim, generator=gen))
        slots += slot[ctx:]
        tables.append(table)
        seq_lens.append(ctx + n)
        starts.append(starts[-1] + n)
    width = max(len(t) for t in tables)
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)

    def meta(padded: int | None) -> AttentionMetadata:
        slot_mapping = torch.tensor(slots)
        if padded is not None:
            extra = padded - len(cases)
            slot_mapping = torch.cat([slot_mapping, torch.full((extra,), fib.scratch_block
                                                              * BLOCK)])
        return AttentionMetadata(query_start_loc=starts, seq_lens=seq_lens,
                                 block_tables=torch.from_numpy(table), slot_mapping=slot_mapping,
                                 block_size=BLOCK, block_tables_host=table, padded_batch=padded)

    scale = dim**-0.5 if scale is None else scale
    m_ref = meta(None)
    ref.prepare(m_ref)
    expected = ref.forward(q, k, v, cache.clone(), m_ref, scale, options)
    m = meta(padded_batch)
    fib.prepare(m)
    fib.plan(m)
    if padded_batch is not None:
        extra = padded_batch - len(cases)
        q = torch.cat([q, torch.randn(extra, heads, dim, generator=gen)])
        k = torch.cat([k, torch.randn(extra, kv_heads, dim, generator=gen)])
        v = torch.cat([v, torch.randn(extra, kv_heads, dim, generator=gen)])
    got = fib.forward(q, k, v, cache, m, scale, options)
    return got[:len(q) if padded_batch is None else len(cases)], expected, fib, cache


def test_flashinfer_backend_matches_torch_paged_on_a_mixed_batch():
    got, expected, fib, _ = step(MIXED)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fib.prefill.num_plans == 1 and fib.decode.num_plans == 0  # one plan per step


def test_flashinfer_backend_uses_the_decode_wrapper_for_pure_decodes():
    got, expected, fib, _ = step(DECODES, heads=8, kv_heads=2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fib.decode.num_plans == 1 and fib.prefill.num_plans == 0


def test_flashinfer_backend_pads_a_decode_for_its_cuda_graph():
    """Padded to the graph's 8 rows: the real rows attend as before; the padding rows write
    and read only the scratch page (the rest of the cache is untouched by them)."""
    got, expected, fib, cache = step(DECODES, padded_batch=8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    wrapper = fib.graph_wrapper(8)
    assert wrapper.use_cuda_graph and wrapper.num_plans == 1
    assert wrapper.last_buf.tolist()[5:] == [1, 1, 1]
    assert fib.scratch_block == cache.shape[1] - 1


def test_the_scratch_page_is_the_engine_caches_last_block():
    """Temporary caches (profiling, embeddings) get their own extra block but never move the
    scratch page of the engine's cache."""
    fib, _, cache = backends(4, 2, 16, 10)
    assert cache.shape[1] == 11 and fib.scratch_block == 10
    (other,) = fib.allocate_kv_cache(1, 3, BLOCK, 2, 16, torch.float32, "cpu")
    assert other.shape[1] == 4 and fib.scratch_block == 10


@pytest.mark.parametrize("cases", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_flashinfer_backend_plans_windows_and_soft_caps(cases):
    """Gemma 2's layers (a soft cap, a sliding window on every other layer, a scale that is
    not head_dim**-0.5): each variant is planned with FlashInfer's parameters
    (``window_left = window - 1``, ``logits_soft_cap``) and matches torch_paged."""
    windowed = AttentionOptions(window=6, soft_cap=2.0)
    got, expected, fib, _ = step(cases, options=windowed, scale=0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fib.variants == (PLAIN, windowed)
    wrapper = fib.prefill_wrapper if cases is MIXED else fib.decode_wrapper
    for options, window_left, cap in ((PLAIN, -1, None), (windowed, 5, 2.0)):
        w = wrapper(options)
        assert w.num_plans == 1  # each variant planned once for the step
        assert (w.planned["window_left"], w.planned["logits_soft_cap"]) == (window_left, cap)
        assert w.planned["sm_scale"] == pytest.approx(16**-0.5)  # q carries the ratio
    plain, _, _, _ = step(cases, options=windowed, scale=16**-0.5)
    assert not torch.allclose(plain, got)  # the scale mattered


def test_flashinfer_variants_in_cuda_graphs():
    windowed = AttentionOptions(window=3)
    got, expected, fib, _ = step(DECODES, padded_batch=8, options=windowed)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert fib.graph_wrapper(8, windowed).planned["window_left"] == 2
    assert fib.graph_wrapper(8).planned["window_left"] == -1
    with pytest.raises(ValueError, match="configure"):
        fib.configure_layers([PLAIN])  # graphs' wrappers exist already


def test_prewarm_compiles_every_kernel_before_serving():
    """prewarm() plans and runs prefill, decode and CUDA-graph decode of every variant (what
    triggers FlashInfer's JIT), on a scratch cache: the engine's cache stays untouched."""
    fib, _, cache = backends(4, 2, 16, 4)
    windowed = AttentionOptions(window=4, soft_cap=30.0)
    fib.configure_layers([windowed, PLAIN])
    before = cache.clone()
    assert fib.prewarm() >= 0
    for options in (windowed, PLAIN):
        assert fib.prefill_wrapper(options).num_plans == 1
        assert fib.decode_wrapper(options).num_plans == 1
        assert fib.prefill_wrapper(options).planned["window_left"] == (3 if options.window
                                                                       else -1)
    assert torch.equal(cache, before) and not fib._graph_wrappers


# -- sampling through FlashInfer's kernels --------------------------------------------------------

V = 64


def batch(*params: SamplingParams, method: str = "flashinfer") -> SamplingBatch:
    return SamplingBatch.build([(p, [1], []) for p in params], vocab_size=V, method=method)


def test_which_batches_flashinfer_samples():
    assert unsupported_reason(batch(SamplingParams(temperature=0))) is not None
    assert unsupported_reason(batch(SamplingParams(temperature=0.7, top_k=5))) is None
    assert unsupported_reason(batch(SamplingParams(top_p=0.9), SamplingParams(temperature=0))
                              ) is None
    assert "seed" in unsupported_reason(batch(SamplingParams(top_p=0.9),
                                              SamplingParams(seed=3)))
    assert "min_p" in unsupported_reason(batch(SamplingParams(min_p=0.1)))


@pytest.fixture
def fake_sampling(monkeypatch):
    fi, sampling = make_module()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", sampling)
    return sampling


def test_sampling_routes_to_flashinfer_with_its_conventions(fake_sampling):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[2] = float("nan")  # a row with no valid mass
    b = batch(SamplingParams(temperature=0.7, top_k=5), SamplingParams(top_p=0.9),
              SamplingParams(temperature=0.5), SamplingParams(temperature=0))
    ids = sample_ids(logits, b)
    (kind, top_k, top_p, order), = fake_sampling.calls
    assert kind == "top_k_top_p" and order == "top_k_first"
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, V, V, V]  # disabled: all
    assert top_p.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])  # disabled: 1.0, not inf
    assert ids[2].item() == NO_TOKEN
    assert ids[3].item() == logits[3].argmax().item()  # the greedy row keeps its argmax
    plain = batch(SamplingParams(temperature=0.9), SamplingParams(temperature=1.0))
    sample_ids(logits[:2], plain)
    assert fake_sampling.calls[-1] == ("plain",)


def test_top_p_alone_never_passes_top_k_vocab(fake_sampling):
    """Per step: a batch with top-p and no top-k samples from the probabilities with the
    top-p kernel; top_k = vocab (a whole-vocabulary top-k pass) is never handed over."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    b = batch(SamplingParams(top_p=0.9), SamplingParams(top_p=0.5), SamplingParams(top_p=1.0))
    ids = sample_ids(logits.clone(), b)
    (kind, top_p), = fake_sampling.calls
    assert kind == "top_p" and top_p.tolist() == pytest.approx([0.9, 0.5, 1.0])
    assert ids.tolist() == logits.argmax(-1).tolist()
    sample_ids(logits.clone(), batch(SamplingParams(top_k=7), SamplingParams(top_k=3)))
    kind, top_k = fake_sampling.calls[-1]
    assert kind == "top_k" and top_k.tolist() == [7, 3]
    assert all(c[0] != "top_k_top_p" for c in fake_sampling.calls)


def test_sampling_prewarm_calls_every_kernel(fake_sampling):
    from asyncengine.executor.sampler.flashinfer_sampling import prewarm

    prewarm("cpu", V, module=fake_sampling)
    assert [c[0] for c in fake_sampling.calls] == ["plain", "top_p", "top_k", "top_k_top_p"]


def test_seeded_and_min_p_batches_take_the_torch_path(fake_sampling):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    seeded = [SamplingParams(temperature=0.8, seed=11), SamplingParams(top_p=0.9)]
    got = sample_ids(logits, batch(*seeded))
    assert fake_sampling.calls == []
    # Exactly the torch path's draw (the exponential race with counter-based noise).
    torch.manual_seed(5)
    expected = sample_ids(logits, batch(*seeded, method="race"))
    assert got[0].item() == expected[0].item()
    sample_ids(logits, batch(SamplingParams(min_p=0.2), SamplingParams(min_p=0.1)))
    assert fake_sampling.calls == []
