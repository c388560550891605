"""The weight formats the decode stack multiplies, one entry each: which modules are of the
format, whether one can be taken, how its ``AeProj`` struct says it (``kernels/stack_layout.h``:
a kind tag and its pointers), and up to how many rows the stack's matmul is the module's own.

``decode_stack.cpp`` dispatches each projection's matmul on its kind (``ae_stack_mm``), in the
way the module's forward multiplies the step's rows, so that the stack's numbers are the
per-layer path's. A further format is one more entry here and one more case there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncengine.executor.paths.stack_layout import CONSTS
from asyncengine.executor.weights import kquants
from asyncengine.executor.weights.int4 import (
    BF16_GEMM_ROWS,
    DEQUANT_ROWS,
    TILE_REQUESTS,
    Int4Linear,
)

PARTS = CONSTS["AE_STACK_PARTS"]
Point = Callable[[torch.Tensor], int]  # an address, the tensor kept alive with the structs


class Format:
    """A weight format (``kind``: its ``AE_W_*`` tag)."""

    name = "?"
    module: type = object
    kind = 0

    @classmethod
    def why_not(cls, lin: Any, dtype: torch.dtype) -> str | None:
        """None when ``lin`` can be multiplied in the stack for ``dtype`` rows."""
        raise NotImplementedError

    @classmethod
    def fill(cls, p: Any, lin: Any, dtype: torch.dtype, point: Point) -> None:
        """``p`` (an AeProj, n and k set) describes ``lin``."""
        raise NotImplementedError

    @classmethod
    def max_rows(cls, lin: Any, dtype: torch.dtype) -> int:
        """The stack takes steps of fewer tokens than this (the module's own kernel's range)."""
        raise NotImplementedError

    @classmethod
    def tile_requests(cls, lin: Any, dtype: torch.dtype) -> int | None:
        """From this many requests a step's matmuls take their byte tiles (None: never)."""
        return None


def _bias_why_not(lin: Any, dtype: torch.dtype) -> str | None:
    bias = lin.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()
                             or bias.device.type != "cpu"):
        return "a bias not in the activations' dtype"
    return None


def _fill_bias(p: Any, lin: Any, point: Point) -> None:
    if lin.bias is not None:
        p.bias = point(lin.bias)


class Int4(Format):
    """``Int4Linear``: int4.cpp's packed rows and float16 (scale, min) per block of 32."""

    name, module, kind = "int4", Int4Linear, CONSTS["AE_W_INT4"]

    @classmethod
    def why_not(cls, lin: Any, dtype: torch.dtype) -> str | None:
        if not (lin.use_kernel and lin.packed.is_contiguous() and lin.scale_min.is_contiguous()):
            return "an int4 projection without its kernel"
        return _bias_why_not(lin, dtype)

    @classmethod
    def fill(cls, p: Any, lin: Any, dtype: torch.dtype, point: Point) -> None:
        p.data[0], p.aux[0] = point(lin.packed), point(lin.scale_min)
        if dtype == torch.bfloat16 and lin._bf16:
            p.flags = CONSTS["AE_INT4_BF16"] | (CONSTS["AE_INT4_TILE8"] if lin._tile8 else 0)
        _fill_bias(p, lin, point)

    @classmethod
    def max_rows(cls, lin: Any, dtype: torch.dtype) -> int:
        # bfloat16 rows without the byte tiles: from BF16_GEMM_ROWS a GEMM, not the kernel
        if dtype == torch.bfloat16 and lin._bf16 and not lin._tile8:
            return BF16_GEMM_ROWS
        return DEQUANT_ROWS

    @classmethod
    def tile_requests(cls, lin: Any, dtype: torch.dtype) -> int | None:
        return TILE_REQUESTS if dtype == torch.bfloat16 and lin._tile8 else None


class GGUF(Format):
    """``GGUFLinear``: a GGUF file's blocks as stored, parts of their own types (kquant.cpp)."""

    name, module, kind = "GGUF blocks", kquants.GGUFLinear, CONSTS["AE_W_GGUF"]

    @classmethod
    def why_not(cls, lin: Any, dtype: torch.dtype) -> str | None:
        if not lin.use_kernel:
            return "GGUF blocks without their kernel"
        if len(lin.qtypes) > PARTS or not all(raw.is_contiguous() for raw, _ in lin.parts()):
            return f"a GGUF projection of more than {PARTS} parts"
        return _bias_why_not(lin, dtype)

    @classmethod
    def fill(cls, p: Any, lin: Any, dtype: torch.dtype, point: Point) -> None:
        flag = lin.flag(dtype)  # each part's type with the flags its calls get
        p.parts = len(lin.qtypes)
        for i, (raw, qtype) in enumerate(lin.parts()):
            p.data[i], p.aux[i], p.rows[i] = point(raw), qtype | flag, raw.shape[0]
        _fill_bias(p, lin, point)

    @classmethod
    def max_rows(cls, lin: Any, dtype: torch.dtype) -> int:
        # from TILE_ROWS GGUFLinear multiplies dequantized tiles, unless (a bfloat16 model)
        # the kernel multiplies those tiles itself, up to FUSED_ROWS
        return kquants.FUSED_ROWS + 1 if kquants.fused_tiles(dtype) else kquants.TILE_ROWS


FORMATS: tuple[type[Format], ...] = (Int4, GGUF)


def format_of(lin: Any) -> type[Format] | None:
    return next((f for f in FORMATS if isinstance(lin, f.module)), None)


def why_not(lin: Any, dtype: torch.dtype) -> str | None:
    """None when the stack multiplies ``lin`` as its forward does for ``dtype`` rows."""
    fmt = format_of(lin)
    if fmt is None:
        return (f"a {type(lin).__name__} projection (the stack takes "
                f"{', '.join(f.name for f in FORMATS)})")
    return fmt.why_not(lin, dtype)


def fill(p: Any, lin: Any, dtype: torch.dtype, point: Point) -> type[Format]:
    """``p`` (an AeProj) describes ``lin`` in its format; returns the format."""
    fmt = format_of(lin)
    assert fmt is not None
    p.kind, p.n, p.k = fmt.kind, lin.out_features, lin.in_features
    fmt.fill(p, lin, dtype, point)
    return fmt
