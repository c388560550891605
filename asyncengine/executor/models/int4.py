"""Weight-only int4 (``--quantization int4``): packed 4-bit weights, one scale and zero per group
of 32 inputs, multiplied by PyTorch's CPU kernel ``torch._weight_int4pack_mm_for_cpu``.

A layer holds only the packed weights (half a byte per weight) and ``[in / 32, out, 2]`` scales
and zeros; nothing is dequantized at load. The kernel's dequantization is
``w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``q`` in [0, 15] and ``g = k // 32``.

- From float weights (safetensors): asymmetric min/max per group, ``scale = (max - min) / 15``,
  ``zero = min + 8 * scale``.
- From a GGUF file's Q4_0 / Q4_1 blocks (32 weights each: ``w = d * (q - 8)`` and
  ``w = d * q + m``): the file's own grid is kept, ``scale = d``, ``zero = 0`` (Q4_0) or
  ``m + 8 * d`` (Q4_1), so the weights are exactly the file's (up to float32 rounding of the
  zero), not a re-quantization. ``gguf.py`` hands the grids over by checkpoint name.

Speed depends on the CPU: see docs/serving.md (CPU speed). On the 2-core AVX2 machine without
AVX-512 this was written on, the kernel is far slower than float32 matmuls, so int4 is opt-in.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32


def quantize_int4(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (q int32 [out, in] in [0, 15], scale, zero: float32
    [in / 32, out]). ``grid``: (scale, zero) [out, in / 32] to quantize onto (a GGUF file's own
    blocks), else min/max per group."""
    out_f, in_f = weight.shape
    w = weight.detach().float().view(out_f, in_f // GROUP, GROUP)
    if grid is None:
        lo, hi = w.amin(dim=2), w.amax(dim=2)  # [out, groups]
        scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        zero = lo + 8 * scale
    else:
        scale, zero = (t.float() for t in grid)
    q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    return q.view(out_f, in_f).to(torch.int32), scale.T.contiguous(), zero.T.contiguous()


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weights an int4 layer computes with."""
    s = scale.T.repeat_interleave(GROUP, dim=1)
    z = zero.T.repeat_interleave(GROUP, dim=1)
    return (q.float() - 8) * s + z


# The packing kernel takes outputs in multiples of 16.
_N_MULTIPLE = 16


def supports_int4(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.shape[1] % GROUP == 0
            and weight.shape[0] % _N_MULTIPLE == 0)


class Int4Linear(nn.Module):
    """``y = x @ dequant(q).T + bias`` from packed int4 weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__()
        if not supports_int4(weight):
            raise ValueError(f"--quantization int4: a {weight.shape[0]}x{weight.shape[1]} linear "
                             f"on {weight.device.type} (needs the CPU, inputs a multiple of "
                             f"{GROUP} and outputs of {_N_MULTIPLE})")
        self.out_features, self.in_features = weight.shape
        q, scale, zero = quantize_int4(weight, grid)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scale_zeros", torch.stack([scale, zero], dim=-1).to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scale_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"
