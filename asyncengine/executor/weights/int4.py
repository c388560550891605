"""Weight-only int4 (``--quantization int4``): packed 4-bit weights, a scale and a minimum per
block of 32 inputs, multiplied by ``packed_kernels.int4_mm``.

A layer holds only the packed nibbles (half a byte per weight) and float16 ``(scale, min)``
pairs per block: ``w[n, k] = q[n, k] * scale[n, b] + min[n, b]`` with ``q`` in [0, 15] and
``b = k // 32``; nothing is dequantized at load. 0.5625 bytes per weight in all, as GGUF's
Q4_1.

- From float weights (safetensors): min/max per block, ``scale = (max - min) / 15``,
  ``min = min``, both rounded to float16 before the weights are rounded onto the grid.
- From a GGUF file's Q4_0 / Q4_1 blocks (``w = d * (q - 8)`` and ``w = d * q + m``, ``d, m``
  float16): the file's own grid is kept, ``scale = d`` and ``min = -8 d`` (Q4_0) or ``m``
  (Q4_1), so the weights are exactly the file's, not a re-quantization. ``gguf.py`` hands the
  grids over by checkpoint name.

The kernel quantizes the activations to int8 per block of 32 inputs, as llama.cpp does for its
Q4 x Q8 dot products; ``tests/executor/test_int4.py`` states what that costs in accuracy. Where the
kernel cannot be compiled (no C++ compiler), the layer multiplies by its dequantized weights,
rebuilt at every call: correct, and slow.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.kernels.where import on_host

GROUP = packed_kernels.GROUP
_F16_MAX = 65504.0
# From this many rows (prefill chunks) a call multiplies by the weights dequantized for that
# call (``packed.int4_dequant``) through MKL, whose blocking beats the kernel's row-at-a-time
# float path there. SmolLM2's four shapes, per layer, kernel against dequantize + MKL on the
# 2-core AVX2 machine (``python /tmp/s5/dq2.py``-style timing): 4.7 / 6.8 ms at 64 rows,
# 8.2 / 7.5 at 100, 21.3 / 17.6 at 256, 43.4 / 29.1 at 512.
DEQUANT_ROWS = 96
# Fewer bfloat16 rows than this (decode batches, verification rows) go through
# ``int4_bf16.cpp`` where it builds (AVX-512 BF16): the weights looked up as bfloat16 once per
# weight row for up to 12 input rows, then one bf16 dot product per 32 weights a row, each
# row's result independent of the row count. SmolLM2's four matmuls of a layer, 2-core EPYC
# (avx512_bf16), 1 thread, bf16 kernel against the float32 paths before it: 125 / 136 us at 1
# row, 250 / 400 at 5, 384 / 850 at 9, 810 / 1970 at 16, 1710 / 15000 at 32 (noisy machine).
BF16_ROWS = DEQUANT_ROWS
# From this many bfloat16 rows (prefill chunks) an int4 call leaves the row kernel: where
# AVX-512 VNNI and BITALG are there, for byte dot products with lanes across 16 weight rows
# over activations rounded to int8 per block of 32 (``int4_tile8.cpp``, kquant_tile8.h's
# kernel on this layout), else for the weights dequantized to bfloat16 for that call through
# PyTorch's bfloat16 GEMM (AVX-512 BF16). SmolLM2's four matmuls of a layer, 2 threads, Zen 5,
# row kernel / dequantize + bfloat16 GEMM / dequantize + float32 GEMM: 0.92 / 0.95 / 2.05 ms
# at 32 rows, 1.81 / 1.34 / 2.75 at 48, 3.73 / 2.04 / 4.71 at 95, 5.11 / 2.51 / 5.98 at 128;
# the int8 tiles 0.33 against the GEMM's 0.60 at 40 rows, 0.68 against 1.03 at 95. Decode-only
# steps of the embedded model (fewer than DEQUANT_ROWS rows) run through the C++ decode stack,
# which picks the kernel by the step's requests alone (TILE_REQUESTS below), so that a
# verification's rows are computed as one-token steps of the same requests compute them.
BF16_GEMM_ROWS = 40
# From this many requests in a step (decode batches), a bfloat16 int4 layer (and an int8 one,
# the logits head: ``int8.Int8Linear``) multiplies through the byte tiles too,
# whatever its row count: at many rows a bfloat16 row costs a vdpbf16ps per 32 weights, a
# tile row 11 instructions per 512 products. SmolLM2's 120 linears, 2 threads, Zen 5, row
# kernel / tiles (``benchmarks/packed_matmul.py --bfloat16``): 1.80 / 3.04 ms at 1 row, 4.28 /
# 4.64 at 9, 7.45 / 6.02 at 16, 14.13 / 9.18 at 32; its int8 head 0.44 / 0.62, 1.15 / 0.94,
# 2.02 / 1.18, 4.21 / 1.82; a 32-request decode step of the embedded model 25-27 -> 19-20 ms.
# Counted in requests, not rows:
# a verification's drafts (a row each) leave its rows' arithmetic that of a one-token step of
# the same requests, so greedy output stays the same with and without speculative decoding.
TILE_REQUESTS = 16


class _Step:
    """The requests of the step whose forward pass is running (``step_requests``); None
    outside one: a call's rows count as its requests."""

    requests: int | None = None


def step_requests_or(rows: int) -> int:
    """The running step's requests; outside a step, ``rows``."""
    return _Step.requests or rows


@contextmanager
def step_requests(requests: int | None) -> Iterator[None]:
    """While a step runs (its forward pass, its logits): its number of requests, which decides
    the kernel of its bfloat16 int4 / int8 matmuls (``TILE_REQUESTS``). One step at a time runs
    the model."""
    before, _Step.requests = _Step.requests, requests
    try:
        yield
    finally:
        _Step.requests = before


def quantize_int4(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (q uint8 [out, in] in [0, 15], scale, min: float16
    [out, in / 32]). ``grid``: (scale, min) [out, in / 32] to quantize onto (a GGUF file's own
    blocks), else min/max per block."""
    out_f, in_f = weight.shape
    w = weight.detach().float().view(out_f, in_f // GROUP, GROUP)
    if grid is None:
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [out, blocks]
        if max(-lo.min().item(), hi.max().item()) > _F16_MAX:
            raise ValueError("--quantization int4: weights beyond float16's range")
        mn = lo.half()
        scale = ((hi - mn.float()) / 15).half()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        scale, mn = (t.half() for t in grid)
    q = torch.round((w - mn.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return q.view(out_f, in_f).to(torch.uint8), scale, mn


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weights an int4 layer holds."""
    out_f, in_f = q.shape
    w = q.float().view(out_f, in_f // GROUP, GROUP) * scale.float()[..., None]
    return (w + mn.float()[..., None]).view(out_f, in_f)


def supports_int4(weight: torch.Tensor) -> bool:
    return on_host(weight) and packed_kernels.supports(weight.shape[1])


class Int4Linear(nn.Module):
    """``y = x @ dequant(q).T + bias`` from packed int4 weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        if not supports_int4(weight):
            raise ValueError(f"--quantization int4: a {weight.shape[0]}x{weight.shape[1]} linear "
                             f"on {weight.device.type} (needs the CPU and inputs a multiple of "
                             f"{GROUP}, at most {packed_kernels.MAX_K})")
        self.out_features, self.in_features = weight.shape
        self.on_grid = grid is not None  # a checkpoint's own (scale, min) per block
        q, scale, mn = quantize_int4(weight, grid)
        self.register_buffer("packed", packed_kernels.pack_int4(q))
        self.register_buffer("scale_min", torch.stack([scale, mn], dim=-1).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = packed_kernels.available("int4")
        self._direct = self.use_kernel and self.bias is None
        self._bf16 = (self._direct and self.in_features % 64 == 0
                      and packed_kernels.int4_bf16_available())
        self._tile8 = self._bf16 and packed_kernels.int4_tile8_available()

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights [out, in] as ``dtype`` (float32, or those rounded to bfloat16), made for
        this call (one C++ pass where the kernels build: ~3x faster than the PyTorch ops below,
        the same values)."""
        if on_host(self.packed) and packed_kernels.available("int4_dequant"):
            return packed_kernels.int4_dequant(self.packed, self.scale_min, dtype)
        q = packed_kernels.unpack_int4(self.packed)
        return dequantize_int4(q, self.scale_min[..., 0], self.scale_min[..., 1]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._direct and x.dtype is torch.float32 and x.dim() == 2
                and x.shape[0] < DEQUANT_ROWS and not torch.compiler.is_compiling()):
            # The decode path, as short as it can be: ~120 of these run per step.
            buffers = self._buffers
            return packed_kernels.int4_mm(x, buffers["packed"], buffers["scale_min"])
        if (self._bf16 and x.dtype is torch.bfloat16 and x.dim() == 2
                and not torch.compiler.is_compiling()):
            buffers = self._buffers
            rows = x.shape[0]
            if rows < BF16_GEMM_ROWS and not (
                    self._tile8 and step_requests_or(rows) >= TILE_REQUESTS):
                return packed_kernels.int4_bf16_mm(x, buffers["packed"],
                                                   buffers["scale_min"]).to(torch.bfloat16)
            if self._tile8:
                return packed_kernels.int4_tile8_mm(x, buffers["packed"], buffers["scale_min"])
            return F.linear(x, self.dequantized(torch.bfloat16))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.use_kernel and x2.shape[0] < DEQUANT_ROWS:
            y = packed_kernels.int4_linear(x2.float(), self.packed, self.scale_min)
        else:
            y = F.linear(x2.float(), self.dequantized())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={GROUP}, kernel={self.use_kernel}")
