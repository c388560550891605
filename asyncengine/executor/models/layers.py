"""The decoder's building blocks: linear, RMSNorm, embedding, the gated MLP, RoPE on heads.

On the CPU in eager mode the small ops (the norm with its fused residual add, RoPE, SiLU * up)
are one own C++ call each (``executor/kernels/layer_ops.py``); on CUDA in bfloat16 or float16,
one FlashInfer kernel each (``executor/kernels/cuda_layer_ops.py``); elsewhere, and under
``torch.compile``, the PyTorch code below them runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.kernels import cuda_layer_ops, layer_ops
from asyncengine.executor.models.rope import apply_rope

# checkpoint projection -> (our fused projection, shard)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _empty(*shape: int) -> nn.Parameter:
    # Weights are loaded (or filled by the dummy loader), never initialized here.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)
        self.bias = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """``w * x / rms(x)``; Gemma's variant (``offset=1``) scales by ``1 + w`` in float32.

    Gemma's norms in float32 weights are turned into the plain form at load
    (``fold_offset``: ``w + 1`` stored); in bfloat16 (where ``1 + w`` would round) the C++
    kernel adds the offset itself."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps
        self.offset = offset

    @torch.no_grad()
    def fold_offset(self) -> None:
        if self.offset and self.weight.dtype == torch.float32:
            self.weight.add_(self.offset)
            self.offset = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` (the
        residual add fused; the given ``residual`` tensor may be updated in place)."""
        if (x.dim() == 2 or residual is None and x.dim() == 3 and x.stride(2) == 1
                and x.stride(1) == x.shape[2]) and layer_ops.usable(x):
            return layer_ops.rms_norm(x, self.weight, self.eps, residual, self.offset)
        if self.offset in (0.0, 1.0) and x.dim() == 2 and cuda_layer_ops.usable(x):
            return cuda_layer_ops.rms_norm(x, self.weight, self.eps, residual,
                                           gemma=self.offset == 1.0)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.offset:  # Gemma: scale in float32, then round
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        # Normalize in float32, scale in the model dtype (as the reference implementation does).
        return self.weight * x32.to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _empty(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up fused in one projection."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {activation!r} is not supported (silu, gelu_tanh)")
        self.activation = activation
        self.intermediate_size = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)

    def shard_rows(self, shard: str) -> tuple[int, int]:
        """(start, size) of a checkpoint shard inside ``gate_up_proj``."""
        return (0 if shard == "gate" else self.intermediate_size), self.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if layer_ops.usable(gate_up):
            return self.down_proj(layer_ops.act_mul(gate_up, self.activation))
        if cuda_layer_ops.usable(gate_up) and cuda_layer_ops.has_activation(self.activation):
            return self.down_proj(cuda_layer_ops.act_mul(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` [T, heads, head_dim]: in place by the CPU kernel (whole heads or their
    first rotary dims), else ``apply_rope``."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and layer_ops.usable(x):
        return layer_ops.rope_(x, cos, sin)
    return apply_rope(x, cos, sin)
