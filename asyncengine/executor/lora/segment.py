"""The batched LoRA op on CUDA: FlashInfer's segment GEMM (``flashinfer.SegmentGEMMWrapper``).

A step's adapter rows are grouped by slot, one segment per slot the step uses (base rows are
left out), and each layer runs two grouped GEMMs over the segments:

- shrink: ``xa[seg] = x[seg] @ A[slot]^T``, with ``A`` [S, R, in] read as column-major
  weights (``weight_column_major=True``: FlashInfer's ``(num_weights, d_out, d_in)``);
- expand: ``ys[seg] = xa[seg] @ B[slot]``, with ``B`` [S, R, out] row-major
  (``(num_weights, d_in, d_out)``);

then ``y.index_add_(0, rows, ys)`` adds them into the projection's output in place.

The grouping is planned on the host, once per step, from the per-token slots the loop
already has (``plan_segments``): the rows' permutation, the segments' ``seg_indptr`` and
their ``weight_indices`` (slot ids) go up with the step's other inputs, and the number of
segments is a host int. Nothing here reads the device back, so a step never synchronizes.

FlashInfer's grouped kernels are bfloat16/float16 only and read 8 elements at a time, so
the slot tables are kept in the model's dtype and every table width (the projection's in
and out features, ``--max-lora-rank`` times the shards it fuses) must be a multiple of 8;
where that or the package is missing, the dense masked path of ``ops.py`` runs instead and
the reason is logged once at start-up. The shrink's result [n, R] comes out in the model's
dtype (FlashInfer's output dtype is its input's; it accumulates in float32) and is rounded
once more before the expand.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncengine.executor.attention import flashinfer_missing
from asyncengine.executor.kernels.where import on_host

logger = logging.getLogger("asyncengine")

#: FlashInfer's encouraged float workspace for its CUTLASS segment GEMM (split results).
WORKSPACE_BYTES = 128 * 1024 * 1024
SEGMENT_DTYPES = (torch.bfloat16, torch.float16)
#: The CUTLASS kernels' access granularity (elements) on every matrix dimension.
GRANULARITY = 8


def segment_gemm_unusable(device: str, dtype: torch.dtype, widths: Iterable[int],
                          importable: bool | str) -> str | None:
    """Why FlashInfer's segment GEMM cannot run the LoRA tables here, or None. ``widths``:
    every dimension of every slot table (in features, out features, rank width);
    ``importable``: True, False (not installed) or the import's error message."""
    missing = flashinfer_missing(device, importable)
    if missing is not None:
        return missing
    if dtype not in SEGMENT_DTYPES:
        return f"its segment GEMM has no {dtype} kernels (use --dtype bfloat16 or float16)"
    odd = sorted({w for w in widths if w % GRANULARITY})
    if odd:
        return (f"its segment GEMM needs every dimension a multiple of {GRANULARITY}, and the "
                f"LoRA tables have {', '.join(map(str, odd))} (a --max-lora-rank that is a "
                f"multiple of {GRANULARITY} gives such tables)")
    return None


def make_segment_gemm(device: torch.device, dtype: torch.dtype,
                      widths: Iterable[int]) -> Any | None:
    """FlashInfer's ``SegmentGEMMWrapper`` for the LoRA tables on ``device``, or None (the
    dense path; on CUDA with one warning naming the reason). The CPU has its own kernel and
    says nothing."""
    if on_host(device):
        return None
    from asyncengine.executor.attention.flashinfer import flashinfer_import_error

    importable: bool | str = flashinfer_import_error() or True
    reason = segment_gemm_unusable(device.type, dtype, widths, importable)
    if reason is not None:
        logger.warning("LoRA: dense masked matmuls over every slot, not FlashInfer's segment "
                       "GEMM: %s", reason)
        return None
    flashinfer = importlib.import_module("flashinfer")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=device)
    logger.info("LoRA: FlashInfer's segment GEMM (%s)", dtype)
    return flashinfer.SegmentGEMMWrapper(workspace)


def plan_segments(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From a step's per-token slots [T] (0: base), on the host: the adapter rows grouped by
    slot (``rows`` [n], stable within a slot), ``seg_indptr`` [k + 1] and the slot of each
    segment (``weight_indices`` [k]), all int64. O(T log T), once per step."""
    adapted = np.flatnonzero(slots)
    rows = adapted[np.argsort(slots[adapted], kind="stable")]
    ids, counts = np.unique(slots[rows], return_counts=True)
    indptr = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return rows.astype(np.int64), indptr, ids.astype(np.int64)


@dataclass
class SegmentPlan:
    """One step's segments on the device (``plan_segments``), and the wrapper to run."""

    rows: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    num_segments: int
    gemm: Any


def segment_add(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                plan: SegmentPlan) -> None:
    """``y[t] += B[s]^T A[s] x[t]`` for the plan's rows, in place (x [T, in], y [T, out];
    ``A`` [S, R, in], ``B`` [S, R, out] in the kernels' dtype)."""
    xs = x.index_select(0, plan.rows)
    if xs.dtype != A.dtype:
        xs = xs.to(A.dtype)
    k = plan.num_segments
    xa = plan.gemm.run(xs, A, k, True, seg_indptr=plan.seg_indptr,
                       weight_indices=plan.weight_indices)
    ys = plan.gemm.run(xa, B, k, False, seg_indptr=plan.seg_indptr,
                       weight_indices=plan.weight_indices)
    y.index_add_(0, plan.rows, ys if ys.dtype == y.dtype else ys.to(y.dtype))


def warm(gemm: Any, A: torch.Tensor, B: torch.Tensor) -> None:
    """One call of each layout on one row: FlashInfer compiles its kernels at first use
    (minutes), which must happen at start-up, never at a step on the loop."""
    dev = A.device
    indptr = torch.tensor([0, 1], dtype=torch.int64, device=dev)
    index = torch.tensor([0], dtype=torch.int64, device=dev)
    xa = gemm.run(torch.zeros(1, A.shape[2], dtype=A.dtype, device=dev), A, 1, True,
                  seg_indptr=indptr, weight_indices=index)
    gemm.run(xa, B, 1, False, seg_indptr=indptr, weight_indices=index)


def prewarm(device: str, dtype: torch.dtype, module: Any = None) -> None:
    """Compile the segment GEMM's kernels for ``dtype`` into FlashInfer's disk cache
    (``python -m asyncengine.executor.runtime.prewarm``); ``module``: a stand-in for
    ``flashinfer``."""
    fi = module if module is not None else importlib.import_module("flashinfer")
    gemm = fi.SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=device))
    A = torch.zeros(1, 16, 64, dtype=dtype, device=device)
    warm(gemm, A, torch.zeros(1, 16, 64, dtype=dtype, device=device))
