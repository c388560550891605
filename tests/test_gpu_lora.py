"""On a GPU: multi-LoRA on FlashInfer's segment GEMM (``executor/lora/segment.py``).

Run with ``pytest -m gpu -rs tests/test_gpu_lora.py``; skipped without CUDA, and the
segment-GEMM tests without the ``flashinfer`` package. THESE TESTS HAVE NEVER RUN (no GPU
was available when they were written): expect to tune the bfloat16 tolerances on the first
run, never the float32 equality.

* The op: bfloat16 tables on the real ``SegmentGEMMWrapper``, a mixed batch (base rows
  between adapter rows), against the float32 product; and no device-to-host synchronization
  in it (``torch.cuda.set_sync_debug_mode("error")``).
* A float32 engine on CUDA takes the dense path (FlashInfer has no float32 kernels) and gives
  PEFT's greedy tokens, base and adapter requests mixed.
* A bfloat16 engine runs the segment GEMM (asserted, no silent fallback), loses no request,
  leaks no block, and agrees with the same engine on the dense path up to bfloat16's near-ties.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from asyncengine.executor.lora import tables
from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
from asyncengine.executor.lora.segment import SegmentPlan, make_segment_gemm, plan_segments
from tests import test_lora
from tests.test_lora import ADAPTERS, PROMPTS, engine_for, peft_reference, run_mixed

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

lora_families = test_lora.lora_families  # the fixture: tiny models with PEFT adapters
#: bfloat16 engine against the dense path: the share of jobs whose tokens agree (before a
#: near-tie flips one, the rest of a greedy sequence follows it)
BF16_AGREE = 0.8


def gpu_table(S: int, R: int, K: int, N: int, dtype: torch.dtype) -> SlotTable:
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(S, R, K, generator=gen) / K**0.5
    B = torch.randn(S, R, N, generator=gen) / R**0.5
    A[0] = B[0] = 0
    span = torch.zeros(S, R, 2, dtype=torch.int64)
    span[..., 1] = N
    return SlotTable(A.to("cuda", dtype), B.to("cuda", dtype), torch.full((S,), R), span)


def segment_step(slots: np.ndarray, S: int, gemm) -> LoRAStep:
    rows, indptr, ids = plan_segments(slots)
    dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    return LoRAStep(dev(slots), S, SegmentPlan(dev(rows), dev(indptr), dev(ids), len(ids), gemm))


def test_segment_gemm_against_float32():
    pytest.importorskip("flashinfer")
    S, R, K, N = 5, 48, 2048, 3072
    gemm = make_segment_gemm(torch.device("cuda"), torch.bfloat16, [R, K, N])
    assert gemm is not None
    table = gpu_table(S, R, K, N, torch.bfloat16)
    slots = np.array([0, 1, 2, 1, 3, 0, 2, 2, 1, 4, 4, 0, 3] * 5, dtype=np.int64)
    x = torch.randn(len(slots), K, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(len(slots), N, device="cuda", dtype=torch.bfloat16)
    want = y.float().clone()
    A, B = table.A.float(), table.B.float()
    for t, s in enumerate(slots.tolist()):
        want[t] += (A[s] @ x[t].float()) @ B[s]
    got = y.clone()
    add_lora(x, got, table, segment_step(slots, S, gemm))
    base = slots == 0
    assert torch.equal(got[torch.from_numpy(base).cuda()], y[torch.from_numpy(base).cuda()])
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)


def test_segment_gemm_never_synchronizes():
    pytest.importorskip("flashinfer")
    S, R, K, N = 5, 16, 512, 512
    gemm = make_segment_gemm(torch.device("cuda"), torch.bfloat16, [R, K, N])
    table = gpu_table(S, R, K, N, torch.bfloat16)
    slots = np.array([0, 1, 2, 3, 4, 1], dtype=np.int64)
    step = segment_step(slots, S, gemm)
    x = torch.randn(len(slots), K, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(len(slots), N, device="cuda", dtype=torch.bfloat16)
    add_lora(x, y, table, step)  # first call outside: any lazy set-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        add_lora(x, y, table, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _jobs(engine) -> list[tuple[list[int], str | None]]:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    names = [None, *ADAPTERS]
    return [(prompts[i], names[i % len(names)]) for i in range(len(prompts))]


def _free(engine) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_float32_on_cuda_gives_pefts_tokens(lora_families):
    paths = lora_families("llama")
    engine = engine_for(paths, max_loras=3, device="cuda")
    assert engine.runner.lora.tables.gemm is None  # float32: the dense path
    jobs = _jobs(engine)
    got = run_mixed(engine, jobs)
    for name in [None, *ADAPTERS]:
        mine = [i for i, (_, n) in enumerate(jobs) if n == name]
        want = peft_reference(paths["base"], paths.get(name) if name else None,
                              [jobs[i][0] for i in mine])
        assert [got[i] for i in mine] == want, name
    assert engine.num_free_blocks == engine.num_total_blocks
    _free(engine)


def test_bfloat16_engine_runs_the_segment_gemm(lora_families, monkeypatch):
    pytest.importorskip("flashinfer")
    import flashinfer

    paths = lora_families("llama")
    engine = engine_for(paths, max_loras=3, device="cuda", dtype="bfloat16")
    lora_tables = engine.runner.lora.tables
    assert isinstance(lora_tables.gemm, flashinfer.SegmentGEMMWrapper)
    assert all(t.A.dtype == torch.bfloat16 for t in lora_tables.tables.values())
    jobs = _jobs(engine) * 3
    got = run_mixed(engine, jobs)
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.num_unfinished_requests == 0
    _free(engine)
    monkeypatch.setattr(tables, "make_segment_gemm", lambda *a: None)
    dense = engine_for(paths, max_loras=3, device="cuda", dtype="bfloat16")
    assert dense.runner.lora.tables.gemm is None
    want = run_mixed(dense, jobs)
    _free(dense)
    agree = sum(g == w for g, w in zip(got, want, strict=True)) / len(jobs)
    assert agree >= BF16_AGREE, agree
