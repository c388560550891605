"""The per-layer decoder: ``CausalLM.forward``, one module call per layer, on any device.

Its small ops pick their kernels op by op (``models/layers.py``): on the CPU in eager mode the
own C++ layer ops (``kernels/layer_ops.py``: the norm with its residual add, RoPE, SiLU * up,
the K/V write, decode attention), on CUDA in bfloat16 / float16 FlashInfer's fused ones
(``kernels/cuda_layer_ops.py``), else PyTorch's. The matmuls are the weights' own linears
(``weights/``: int4, int8, GGUF blocks kept packed, or float). It takes every step of every
phase, so it ends every chain but tensor parallelism's.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine.executor.kernels import cuda_layer_ops, layer_ops
from asyncengine.executor.paths.base import PathContext, StepPath, begin


class Eager(StepPath):
    name = "eager"
    total = True

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        if ctx.tp is not None:
            return "every step is broadcast to the tensor-parallel workers (tensor_parallel)"
        return None

    def __init__(self, ctx: PathContext) -> None:
        super().__init__(ctx)
        self.ctx = ctx

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor:
        r = self.runner
        begin(inputs, last_sampled, r.attn_backend)
        return r.model(inputs.input_ids, inputs.positions, r.kv_caches, inputs.attn_metadata,
                       r.attn_backend)

    def describe(self) -> str:
        return f"eager (per layer, {_op_kernels(self.ctx)})"


def _op_kernels(ctx: PathContext) -> str:
    """Which kernels the layers' small ops take (for the log)."""
    if ctx.device_type == "cpu":
        if not layer_ops.ENABLED:
            return f"PyTorch ops: {layer_ops.ENV}=0"
        norm = getattr(getattr(ctx.model, "model", None), "norm", None)
        dtype = norm.weight.dtype if norm is not None else torch.float32
        return "C++ layer ops" if layer_ops.available(dtype) else "PyTorch ops: not built"
    if ctx.device_type == "cuda":
        return "FlashInfer layer ops" if cuda_layer_ops.active() else "PyTorch ops"
    return "PyTorch ops"
