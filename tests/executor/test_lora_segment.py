"""The CUDA LoRA path (FlashInfer's segment GEMM, ``executor/lora/segment.py``) on the CPU,
through the stand-in ``flashinfer_standin.SegmentGEMMWrapper``: the host's segment plan, the
path's y against the C++ kernel's and the dense path's, the reasons it is not chosen, and a
whole engine on it giving PEFT's greedy tokens for a mixed batch. The real kernels run in
``test_gpu_lora.py`` on a GPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from asyncengine.executor.lora import ops, tables
from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
from asyncengine.executor.lora.segment import (
    SegmentPlan,
    make_segment_gemm,
    plan_segments,
    segment_gemm_unusable,
)
from asyncengine.executor.runtime.flashinfer_standin import SegmentGEMMWrapper
from tests.engine import test_lora
from tests.engine.test_lora import ADAPTERS, PROMPTS, engine_for, peft_reference, run_mixed

lora_families = test_lora.lora_families  # the fixture: tiny models with PEFT adapters


def test_plan_segments_by_hand():
    rows, indptr, ids = plan_segments(np.array([0, 3, 1, 3, 0, 1, 1, 2], dtype=np.int64))
    assert rows.tolist() == [2, 5, 6, 7, 1, 3]  # slot 1's rows, slot 2's, slot 3's; no base
    assert indptr.tolist() == [0, 3, 4, 6]
    assert ids.tolist() == [1, 2, 3]
    assert all(a.dtype == np.int64 for a in (rows, indptr, ids))
    rows, indptr, ids = plan_segments(np.zeros(4, dtype=np.int64))
    assert rows.tolist() == [] and indptr.tolist() == [0] and ids.tolist() == []


def random_table(gen: torch.Generator, S: int = 5, R: int = 16, K: int = 64, N: int = 96
                 ) -> SlotTable:
    """Slot 0 zero; slot 2 uses 5 of its R rows; slot 3's rows write two column spans."""
    A = torch.randn(S, R, K, generator=gen)
    B = torch.randn(S, R, N, generator=gen)
    A[0] = B[0] = 0
    A[2, 5:] = B[2, 5:] = 0
    rows = torch.full((S,), R)
    rows[0], rows[2] = 0, 5
    span = torch.zeros(S, R, 2, dtype=torch.int64)
    span[..., 1] = N
    span[3, :8] = torch.tensor([0, 40])
    span[3, 8:] = torch.tensor([40, N])
    B[3, :8, 40:] = 0
    B[3, 8:, :40] = 0
    return SlotTable(A, B, rows, span)


def segment_step(slots: torch.Tensor, S: int, gemm: SegmentGEMMWrapper) -> LoRAStep:
    rows, indptr, ids = plan_segments(slots.numpy())
    plan = SegmentPlan(torch.from_numpy(rows), torch.from_numpy(indptr), torch.from_numpy(ids),
                       len(ids), gemm)
    return LoRAStep(slots, S, plan)


def test_segment_path_equals_the_kernel_and_the_dense_path():
    gen = torch.Generator().manual_seed(0)
    table = random_table(gen)
    S = table.A.shape[0]
    slots = torch.tensor([0, 1, 2, 1, 3, 0, 2, 2, 1, 4, 4, 0, 3])  # base rows between
    T = len(slots)
    x = torch.randn(T, table.A.shape[2], generator=gen)
    base = torch.randn(T, table.B.shape[2], generator=gen)
    want = base.clone()
    for t in range(T):
        s = int(slots[t])
        want[t] += (table.A[s] @ x[t]) @ table.B[s]
    gemm = SegmentGEMMWrapper(torch.empty(0, dtype=torch.int8))
    got = base.clone()
    add_lora(x, got, table, segment_step(slots, S, gemm))
    # two grouped GEMMs over the 4 slots in use, on the 10 adapter rows only
    assert gemm.calls == [(10, 4, True), (10, 4, False)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[slots == 0], base[slots == 0])  # base rows untouched
    if ops.kernel(torch.float32) is not None:
        kernel = base.clone()
        add_lora(x, kernel, table, LoRAStep(slots, S))
        torch.testing.assert_close(got, kernel, rtol=1e-5, atol=1e-4)
    dense = test_lora.dense_add_lora(x, base, table, slots, S)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-4)


def test_segment_path_in_bfloat16_tables():
    """The tables in the model's dtype (as on CUDA): within bfloat16's rounding of the float32
    result."""
    gen = torch.Generator().manual_seed(1)
    table = random_table(gen)
    S = table.A.shape[0]
    slots = torch.tensor([3, 0, 1, 1, 4, 2])
    x = torch.randn(len(slots), table.A.shape[2], generator=gen)
    want = torch.zeros(len(slots), table.B.shape[2])
    add_lora(x, want, table, segment_step(slots, S, SegmentGEMMWrapper(torch.empty(0))))
    half = SlotTable(table.A.bfloat16(), table.B.bfloat16(), table.rows, table.span)
    got = torch.zeros(len(slots), table.B.shape[2], dtype=torch.bfloat16)
    add_lora(x.bfloat16(), got, half, segment_step(slots, S, SegmentGEMMWrapper(torch.empty(0))))
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.5)


def test_why_the_segment_gemm_is_not_used():
    bf16 = torch.bfloat16
    assert "CUDA only" in segment_gemm_unusable("cpu", bf16, [64], True)
    assert "not installed" in segment_gemm_unusable("cuda", bf16, [64], False)
    assert "import failed: OSError: libcuda" in segment_gemm_unusable(
        "cuda", bf16, [64], "OSError: libcuda")
    assert "float32" in segment_gemm_unusable("cuda", torch.float32, [64], True)
    reason = segment_gemm_unusable("cuda", bf16, [64, 3, 12, 48], True)
    assert "3, 12" in reason and "--max-lora-rank" in reason
    assert segment_gemm_unusable("cuda", torch.float16, [64, 48, 8], True) is None


def test_cuda_without_flashinfer_takes_the_dense_path_and_says_why(monkeypatch, caplog):
    from asyncengine.executor.attention import flashinfer as fi_backend

    monkeypatch.setattr(fi_backend, "flashinfer_import_error",
                        lambda: "ModuleNotFoundError: No module named 'flashinfer'")
    with caplog.at_level(logging.WARNING, logger="asyncengine"):
        assert make_segment_gemm(torch.device("cuda"), torch.bfloat16, [64, 48]) is None
    warned = [r.getMessage() for r in caplog.records if "segment GEMM" in r.getMessage()]
    assert len(warned) == 1 and "not installed" not in warned[0]
    assert "No module named 'flashinfer'" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncengine"):  # the CPU has its kernel
        assert make_segment_gemm(torch.device("cpu"), torch.float32, [64]) is None
    assert not caplog.records


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_engine_on_the_segment_path_gives_pefts_tokens(lora_families, monkeypatch,
                                                       quantization):
    """A whole engine whose LoRA runs the CUDA path's code (the fake segment GEMM, float32
    on the CPU): base and adapter requests mixed give PEFT's greedy tokens."""
    made: list[SegmentGEMMWrapper] = []

    def fake_gemm(device, dtype, widths):
        assert segment_gemm_unusable("cuda", torch.bfloat16, widths, True) is None
        made.append(SegmentGEMMWrapper(torch.empty(0, dtype=torch.int8)))
        return made[0]

    monkeypatch.setattr(tables, "make_segment_gemm", fake_gemm)
    paths = lora_families("llama")
    engine = engine_for(paths, max_loras=3, quantization=quantization)
    gemm = engine.runner.lora.tables.gemm
    assert gemm is made[0] and gemm.calls == [(1, 1, True), (1, 1, False)]  # warmed up
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    names = [None, *ADAPTERS]
    jobs = [(prompts[i], names[i % len(names)]) for i in range(len(prompts))]
    if quantization != "none":
        from tests.engine.test_lora import dequantized_state

        state = dequantized_state(engine)
    else:
        state = None
    want = {}
    for name in names:
        mine = [i for i, (_, n) in enumerate(jobs) if n == name]
        got = peft_reference(paths["base"], paths.get(name) if name else None,
                             [jobs[i][0] for i in mine], state)
        want.update(zip(mine, got, strict=True))
    got = run_mixed(engine, jobs)
    assert got == [want[i] for i in range(len(jobs))]
    # the adapter rows ran through the segment GEMM, in steps mixing several adapters
    assert len(gemm.calls) > 2 and max(k for _, k, _ in gemm.calls) > 1
    assert engine.num_free_blocks == engine.num_total_blocks
    # the C++ decode stack (int4) leaves steps on the segment path to the layers' hooks
    assert getattr(getattr(engine.runner.paths.path("cpu_stack"), "stack", None), "lora_steps",
                   0) == 0


def test_engine_on_the_cuda_step_path_with_the_segment_gemm(lora_families, monkeypatch):
    """The CUDA device's step path (fake CUDA: steps enqueued, packed pinned-style staging, event
    awaits) with the segment GEMM: the segments travel with the step's staged inputs and the
    tokens equal the CPU kernel's engine's."""
    from asyncengine.executor.runtime.simulated import on_simulated_cuda as cuda_path

    paths = lora_families("llama")
    reference = engine_for(paths, max_loras=3)
    assert reference.runner.lora.tables.gemm is None
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS]
    names = [None, *ADAPTERS]
    jobs = [(prompts[i], names[i % len(names)]) for i in range(len(prompts))] * 2
    want = run_mixed(reference, jobs)
    monkeypatch.setattr(tables, "make_segment_gemm",
                        lambda *a: SegmentGEMMWrapper(torch.empty(0, dtype=torch.int8)))
    engine = engine_for(paths, max_loras=3)
    device = cuda_path(engine, "thread")
    executed = []
    real_execute = engine.runner.execute
    engine.runner.execute = lambda inputs: executed.append(inputs) or real_execute(inputs)
    got = run_mixed(engine, jobs)
    assert got == want
    # every step was enqueued by the CUDA device
    assert len(executed) == device.num_loop_launches + device.num_thread_launches
    assert max(k for _, k, _ in engine.runner.lora.tables.gemm.calls) > 1
    assert engine.num_free_blocks == engine.num_total_blocks
