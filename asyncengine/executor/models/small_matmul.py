"""Linears of very few rows on the CPU: bfloat16 ones skip oneDNN.

PyTorch sends bfloat16 matmuls on the CPU to oneDNN when it is enabled. For a few rows (a
decode step of a few requests) ATen's own kernel is faster, because it streams the weights at
close to memory bandwidth: measured on a 2-core AVX512-BF16 CPU with torch 2.13, the 120
decoder linears of SmolLM2-135M take ~15.5 ms through oneDNN and ~8.5 ms through ATen at one
row (the 49152-row logits head ~3.5 vs ~2.0 ms) and ~18 vs ~12 ms at two rows; at three rows
a decode step takes as long either way, from four rows on oneDNN wins. Both kernels
accumulate in float32 and round once, so they agree with the correctly rounded product (and
differ in rare ties only). float32 matmuls go to MKL either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from asyncengine.executor.kernels.where import on_host

# At most this many rows skip oneDNN.
SMALL_ROWS = 2


@contextlib.contextmanager
def small_matmuls(x: torch.Tensor) -> Iterator[None]:
    """Run the block's matmuls over activations like ``x`` ([rows, features]) on the kernel
    that is fastest for their number of rows."""
    if (not on_host(x) or x.dtype != torch.bfloat16 or x.shape[0] > SMALL_ROWS
            or not torch.backends.mkldnn.enabled):
        yield
        return
    # A process-wide switch: only the forward pass runs matmuls while it is off (one step
    # at a time, on the device's worker thread), and it is back on when the block ends.
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
