"""Weight-only int8 (``--quantization int8``, and the logits head of ``int4``): symmetric int8
weights per output channel (``w[n, k] ~= q[n, k] * scale[n]``, ``q`` in [-127, 127]) or per
block of 32 inputs as a GGUF file's Q8_0 stores them, multiplied by
``packed_kernels.int8_mm``; and the token embedding that reads a tied int8 head's rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.weights.int4 import BF16_ROWS, TILE_REQUESTS, step_requests_or


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], float32 scales [out]) with
    ``weight ~= q * scales[:, None]``; a row of zeros gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights an int8 layer holds: ``q * scales`` (scales [out] or [out, blocks])."""
    s = scales.float()
    s = s[:, None] if s.dim() == 1 else s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    return (q.float() * s).to(dtype)


class Int8Linear(nn.Module):
    """``y = x @ (q * scales).T + bias`` from int8 weights (``packed_kernels.int8_mm``).

    ``grid``: (q int8 [out, in], scales float32 [out, in / 32]) as a GGUF file's Q8_0 stores
    them; else per-channel scales from ``weight``. ``float32_out``: the output stays float32
    whatever the input's dtype (the logits head: its kernel sums in float32 anyway, and
    rounding logits to bfloat16 makes near ids tie, so that greedy picks the lower id)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 float32_out: bool = False) -> None:
        super().__init__()
        self.float32_out = float32_out
        if grid is None:
            assert weight is not None
            q, scales = quantize_int8(weight)
            scales = scales[:, None]
        else:
            q, scales = grid[0].to(torch.int8), grid[1].float()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = (on_host(q) and packed_kernels.supports(
            self.in_features, self.in_features // scales.shape[1])
            and packed_kernels.available("int8"))
        # Few bfloat16 rows: ``int8_bf16.cpp`` (exact weights, one bf16 dot product per 32
        # weights a row, each row's result independent of the row count).
        self._bf16 = (self.use_kernel and scales.shape[1] in (1, self.in_features // 32)
                      and self.in_features % 64 == 0
                      and packed_kernels.bf16_available("int8_bf16"))
        # Steps of TILE_REQUESTS requests or more: byte tiles over activations rounded to int8
        # (``int8_tile8.cpp``, AVX-512 VNNI and BITALG), as Int4Linear's layers take them.
        self._tile8 = self._bf16 and packed_kernels.bf16_available("int8_tile8")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        dtype = torch.float32 if self.float32_out else x.dtype
        if (self._bf16 and x2.dtype is torch.bfloat16 and x2.shape[0] < BF16_ROWS
                and not torch.compiler.is_compiling()):
            mm = (packed_kernels.int8_tile8_mm
                  if self._tile8 and step_requests_or(x2.shape[0]) >= TILE_REQUESTS
                  else packed_kernels.int8_bf16_mm)
            y = mm(x2, self.qweight, self.scales).to(dtype)
        elif self.use_kernel:
            y = packed_kernels.int8_linear(x2.float(), self.qweight, self.scales).to(dtype)
        else:
            y = F.linear(x2.to(dtype), self.dequantized(dtype))
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.in_features // self.scales.shape[1]}, kernel={self.use_kernel}")


class Int8Embedding(nn.Module):
    """The token embedding of a model whose tied int8 head holds the GGUF file's Q8_0 blocks
    (``install_gguf``): a lookup reads the head's rows, ``q * scale`` in float32 (exactly the
    value the file's Q8_0 dequantizes to: an 11-bit float16 scale times a 7-bit integer),
    then the model's dtype. No second copy of the vocabulary."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", head.qweight)
        self.register_buffer("scales", head.scales)
        self.dtype = dtype
        self.num_embeddings, self.dim = head.qweight.shape
        self.block = self.dim // head.scales.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        n = flat.shape[0]
        q = self.qweight.index_select(0, flat).view(n, -1, self.block)
        rows = q * self.scales.index_select(0, flat).unsqueeze(2)  # float32, exact
        return rows.to(self.dtype).view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, group={self.block}, dtype={self.dtype}"
