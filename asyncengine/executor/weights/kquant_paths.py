"""Which path multiplies a GGUF matrix (``kquants.py``), by row count, CPU and dtype: the
packed kernel's byte dot products below ``TILE_ROWS`` rows, from there the kernel's own tiles
(int8 or bfloat16, ``fused_tiles``) or tiles of dequantized weights through oneDNN / MKL
(``tile_dtype``); whether the kernels build at all (``kernels_available``). The choice is
logged once at start-up."""

from __future__ import annotations

import logging

import torch

from asyncengine.executor.kernels import packed as packed_kernels

logger = logging.getLogger(__name__)

# From this many input rows, a call multiplies tiles of dequantized weights through oneDNN /
# MKL instead of the packed kernel (kquant.cpp's byte dot products, 8 rows per pass). Layer 0's
# MLP of the Qwen2.5-0.5B-shaped Q4_K_M (benchmarks/kquants.py --matrices), best of 20, one
# thread, on the loaded 2-core Zen 5 (avx512_bf16, avx512_vnni) of docs/benchmarks.md, Q5_0
# gate / Q6_K down (4.4 M weights each), kernel vs bfloat16 tiles in ms: 1 row 0.18 / 0.12 vs
# 1.38 / 1.16; 8 rows 0.48 / 0.69 vs 1.49 / 1.25; 16 rows 1.06 / 1.35 vs 1.62 / 1.44; 32 rows
# 2.11 / 2.72 vs 1.93 / 1.80: the tiles win from between 16 and 32 rows. (With AVX-512 BF16
# the kernel multiplies those tiles itself from here on, up to ``FUSED_ROWS``.)
TILE_ROWS = 16
# Up to this many input rows a bfloat16 model's calls keep to the kernel where it multiplies
# bfloat16 tiles itself (``kquant_tile.h``; its activations, 64 x 4864 in bfloat16, then stay
# in L2): a 32-token decode step of the file above, same run, 205.5 ms with Python's tiles,
# 168.0 ms with the kernel's, 137.3 ms in the decode stack (docs/benchmarks.md). Larger
# prefill chunks go on to ``_tiled``.
FUSED_ROWS = 64
# The types ``kquant_tile8.h`` multiplies (AVX-512 VNNI and BF16) from ``TILE_ROWS`` rows at any
# row count, prefill chunks included (in panels of 128 rows): byte dot products over
# activations rounded to int8 once per block of 32, ~1.3x oneDNN's bfloat16 GEMM over
# dequantized tiles for a 2048-token chunk of the Q4_K_M file (docs/benchmarks.md).
INT8_TILE_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4/5/6_K

def tile_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tiled path (``TILE_ROWS`` rows and more), chosen once per process:
    bfloat16 where the model runs in bfloat16 and the CPU multiplies bfloat16 natively
    (avx512_bf16 / amx_bf16: oneDNN's bfloat16 GEMM is ~5x its float32 one there), else
    float32 (on AVX2-only CPUs bfloat16 is emulated and slower). The packed kernel below
    ``TILE_ROWS`` sums in float32 on every CPU: decode at small batches is bound by reading the
    weights, and the packed bytes are 3-4x fewer than bfloat16's."""
    global _CHOICE_LOGGED
    from asyncengine.executor.runtime.cpu_flags import cpu_has_bf16 as _cpu_has_bf16

    bf16 = _cpu_has_bf16()
    if not _CHOICE_LOGGED:
        _CHOICE_LOGGED = True
        int8 = bf16 and kernels_available() and packed_kernels.kquant_int8_tile()
        logger.info("GGUF matmuls: the packed kernel below %d input rows, from there %stiles "
                    "of dequantized weights in %s (this CPU %s bfloat16 dot products)", TILE_ROWS,
                    "int8 tiles for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K when the model is "
                    "bfloat16 (AVX-512 VNNI), else " if int8 else "",
                    "bfloat16 when the model is" if bf16 else "float32",
                    "has" if bf16 else "lacks")
    return torch.bfloat16 if bf16 and x_dtype == torch.bfloat16 else torch.float32


_CHOICE_LOGGED = False


def fused_tiles(dtype: torch.dtype) -> bool:
    """Whether, for activations of ``dtype``, the kernel itself multiplies from ``TILE_ROWS``
    rows (AVX-512 BF16: ``kquant_tile.h``'s bfloat16 tiles, the arithmetic of ``_tiled``'s up
    to float32 summation order, or ``kquant_tile8.h``'s byte dot products for the blocks of
    32 and the k-quants; no tile leaves the cache, no Python per tile)."""
    return (tile_dtype(dtype) == torch.bfloat16 and kernels_available()
            and packed_kernels.kquant_bf16_tile())


_WARNED = False


def kernels_available() -> bool:
    """Whether the kquant kernels build here; the first time they do not, one warning."""
    global _WARNED
    ok = packed_kernels.available("kquant") and packed_kernels.available("kquant_dequant")
    if not ok and not _WARNED:
        _WARNED = True
        logger.warning("the GGUF kernels (kquant) cannot be compiled here: GGUF weights are "
                       "dequantized a tile at a time by PyTorch (correct, slow)")
    return ok
