"""On a GPU: multi-LoRA on FlashInfer's segment GEMM (``executor/lora/segment.py``).

Run with ``pytest -m gpu -rs tests/gpu/test_gpu_lora.py``; skipped without CUDA, and the
segment-GEMM tests without the ``flashinfer`` package. They first ran on an H100 on
2026-11-27: the op, its no-synchronization check and the float32 engine passed, twice; the
bfloat16 engine's criterion was revised after each run (below). Never loosen the float32
equality.

* The op: bfloat16 tables on the real ``SegmentGEMMWrapper``, a mixed batch (base rows
  between adapter rows), against the float32 product; and no device-to-host synchronization
  in it (``torch.cuda.set_sync_debug_mode("error")``).
* A float32 engine on CUDA takes the dense path (FlashInfer has no float32 kernels) and gives
  PEFT's greedy tokens, base and adapter requests mixed.
* A bfloat16 engine runs the segment GEMM (asserted, no silent fallback), loses no request,
  leaks no block, and scores each job's prompt and greedy output as the same engine on the
  dense path does: the mean logprob difference within a quarter of what the job's adapter
  moves (dense with it against dense without), and base rows within bfloat16's noise.
  (Greedy sequences said little: the tiny random model is nearly uniform, its top tokens
  within hundredths of a nat, so bfloat16's rounding parts them at any near-tie. The first
  GPU run asked for 80% of whole sequences equal and got 67%; the second, for parting
  tokens among the dense path's best two within 0.01 nats, found a third token 0.12 nats
  down at the first output token.) On the CPU, bfloat16 against float32 on the dense path
  differs by a mean of ~0.005 nats; an adapter moves ~0.2.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from asyncengine.executor.lora import tables
from asyncengine.executor.lora.ops import LoRAStep, SlotTable, add_lora
from asyncengine.executor.lora.segment import SegmentPlan, make_segment_gemm, plan_segments
from tests.engine import test_lora
from tests.engine.test_lora import ADAPTERS, PROMPTS, engine_for, peft_reference, run_mixed

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

lora_families = test_lora.lora_families  # the fixture: tiny models with PEFT adapters


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


def prompt_logprobs(engine, jobs: list[tuple[list[int], str | None]]) -> list[torch.Tensor]:
    """Each job's prompt tokens' logprobs (from the second on) under ``engine``, with the
    job's adapter; the engine runs (and is closed) here."""
    import anyio

    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out: list[torch.Tensor] = [torch.empty(0)] * len(jobs)

    async def one(i: int) -> None:
        ids, name = jobs[i]
        async for o in engine.generate(ids, params, lora_name=name):
            if o.finished:
                out[i] = torch.tensor([lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:],
                                                                         ids[1:], strict=True)])

    async def main() -> None:
        async with engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return out


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
    assert [len(g) for g in got] == [test_lora.N] * len(jobs)
    # each job's prompt and greedy output, scored by both paths with the job's adapter
    scored = [(ids + out, name) for (ids, name), out in zip(jobs, got, strict=True)]
    segment = prompt_logprobs(engine, scored)
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.num_unfinished_requests == 0
    _free(engine)
    monkeypatch.setattr(tables, "make_segment_gemm", lambda *a: None)
    dense = engine_for(paths, max_loras=3, device="cuda", dtype="bfloat16")
    assert dense.runner.lora.tables.gemm is None
    both = prompt_logprobs(dense, scored + [(ids, None) for ids, _ in scored])
    want, base = both[:len(scored)], both[len(scored):]
    assert dense.num_free_blocks == dense.num_total_blocks
    _free(dense)
    for i, (_, name) in enumerate(scored):
        error = (segment[i] - want[i]).abs().mean().item()
        if name is None:  # the base rows between adapter rows: untouched by the GEMM
            assert error <= 0.02, (i, error)
            continue
        effect = (want[i] - base[i]).abs().mean().item()
        assert error <= 0.25 * effect, (i, name, error, effect)
