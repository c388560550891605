"""The batched LoRA op: each token row adds its own adapter's update, in one call per layer.

``add_lora(x, y, table, step)`` computes, in place, ``y[t] += B[s]^T (A[s] x[t])`` for every
row ``t`` with slot ``s = step.slots[t] > 0`` (slot 0 is the base model). There is no Python
loop over adapters:

- **CPU** (float32 / bfloat16 activations): ``kernels/lora.cpp``, segmented: the rows are
  grouped by slot (base rows dropped) into tiles of up to 8 rows that read their adapter's
  A and B once, only the rows it uses (``table.rows[s]``) and, of B, only each row's shard
  columns (``table.span``); threads take tiles.
- **CUDA** with FlashInfer (bfloat16 / float16): its segment GEMM, rows grouped by slot on
  the host once per step, base rows left out, a shrink and an expand per layer over the
  step's segments (``segment.py``; the step's ``segments`` plan).
- **elsewhere** (CUDA without FlashInfer or in float32, or no C++ compiler): two dense
  matmuls over every slot at once, ``xa = x @ A_all^T`` ([T, S * R]), masked to each row's
  own slot by the step's one-hot ``[T, S]``, then ``y += xa @ B_all``. It costs ``S`` times
  the arithmetic of a per-row gather, which is small beside the base matmul at the ranks
  served (``S = --max-loras``), and it never synchronizes with the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from asyncengine.config import environment
from asyncengine.executor.kernels.build import DTYPE_CODES, load
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.lora.segment import SegmentPlan, segment_add

logger = logging.getLogger(__name__)

_ARGS = ("const ae_t*", "ae_t*", "const float*", "const float*", "const int64_t*",
         "const int64_t*", "const int64_t*", "int64_t", "int64_t", "int64_t", "int64_t",
         "int64_t", "int64_t")
_KERNELS: dict[torch.dtype, object | None] = {}
#: ``ASYNCENGINE_LORA_KERNEL=0`` takes the PyTorch path on the CPU too (for comparisons).
USE_KERNEL = environment.on("ASYNCENGINE_LORA_KERNEL")


def kernel(dtype: torch.dtype) -> object | None:
    """The compiled ``lora.cpp`` for activations of ``dtype`` (None: not buildable here)."""
    if dtype not in _KERNELS:
        code = DTYPE_CODES.get(dtype)
        _KERNELS[dtype] = None if code is None else load("lora", _ARGS, code)
    return _KERNELS[dtype]


@dataclass
class LoRAStep:
    """One step's slots, on the step's device: ``slots`` [T] int64 (0: base row), and where
    the tables run on FlashInfer's segment GEMM, the step's ``segments``."""

    slots: torch.Tensor
    num_slots: int  # S, slot 0 included
    segments: SegmentPlan | None = None
    _onehot: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def onehot(self, dtype: torch.dtype) -> torch.Tensor:
        """[T, S - 1]: 1 where a row uses slot s (slots 1..S-1), for the dense path."""
        m = self._onehot.get(dtype)
        if m is None:
            ids = torch.arange(1, self.num_slots, device=self.slots.device)
            m = self._onehot[dtype] = (self.slots[:, None] == ids).to(dtype)
        return m


@dataclass
class SlotTable:
    """One adapted module's slots: ``A`` [S, R, in], ``B`` [S, R, out] (float32; the model's
    dtype under FlashInfer's segment GEMM), and for the
    kernel (on the CPU): the rows each slot uses, ``rows`` [S] int64, and each row's span of
    output columns, ``span`` [S, R, 2] int64 (B is zero outside it)."""

    A: torch.Tensor
    B: torch.Tensor
    rows: torch.Tensor
    span: torch.Tensor

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
              span: torch.Tensor | None = None) -> None:
        """Put an adapter's (A, B) into ``slot`` (None: the adapter leaves this module)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        n = 0 if a is None else a.shape[0]
        self.span[slot].zero_()
        if n:
            self.A[slot, :n].copy_(a)
            self.B[slot, :n].copy_(b)
            if span is None:
                self.span[slot, :n, 1] = b.shape[1]
            else:
                self.span[slot, :n].copy_(span)
        self.rows[slot] = n


def add_lora(x: torch.Tensor, y: torch.Tensor, table: SlotTable, step: LoRAStep) -> None:
    """``y[t] += B[s]^T A[s] x[t]`` for each row's slot ``s`` (in place; x [T, in], y [T, out])."""
    T = x.shape[0]
    if T != step.slots.shape[0] or x.dim() != 2:
        raise ValueError(f"LoRA: {T} rows against {step.slots.shape[0]} slots")
    if step.segments is not None:
        segment_add(x, y, table.A, table.B, step.segments)
        return
    if (USE_KERNEL and on_host(x) and y.dtype == x.dtype and x.stride(-1) == 1
            and y.stride(-1) == 1 and not torch.compiler.is_compiling()):
        fn = kernel(x.dtype)
        if fn is not None:
            S, R, K = table.A.shape
            fn(x, y, table.A, table.B, step.slots, table.rows, table.span, T, K,
               table.B.shape[2], R, x.stride(0), y.stride(0))
            return
    S, R, K = table.A.shape
    N = table.B.shape[2]
    a = table.A[1:].reshape((S - 1) * R, K)
    b = table.B[1:].reshape((S - 1) * R, N)
    xa = (x.to(a.dtype) @ a.T).view(T, S - 1, R) * step.onehot(a.dtype)[:, :, None]
    y += (xa.view(T, (S - 1) * R) @ b).to(y.dtype)
