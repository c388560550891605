"""Greedy tokens straight from the hidden states, without the ``[N, vocab]`` logits.

A decode step of many greedy rows on the CPU spends most of its time in the logits head and
the argmax after it, and much of that moving the logits through memory: at 256 rows and a
49,152-token vocabulary they are 50 MB of float32, written by the matmul and read back by the
argmax. Here the head runs over the vocabulary a slice at a time into one reused buffer that
stays in cache, and the argmax of each slice is merged into a running best. The result is the
argmax of the full logits, ties going to the lowest id as ``argmax`` does: a slice's maximum
replaces the running one only when strictly greater. A row whose best value is NaN or
infinite gets ``NO_TOKEN``, as in the sampler's greedy path.

Used only where it pays and changes nothing else: on the CPU, for steps whose rows are all
greedy with no logit processing, no logprobs and no grammar mask.

Float32 rows go through an own C++ kernel (``kernels/greedy_head.cpp``) that does the
matmul and the argmax together, in registers: per row a running best per vector lane, updated
by compares and blends, merged at the end (ties to the lowest id). Its threads take chunks of
the vocabulary as they come free, so a thread that loses its core to the event loop holds back
one chunk, not half the call. Its inner loop by shape: below 4 rows, dot products along the
hidden size; else 16 rows in the lanes of a vector against 6 vocabulary rows at a time, the
weight read in place; or, where that would leave over a quarter of the lanes idle (17-23,
33-35 rows, ...; not up to 16 rows at hidden >= 256), 6 rows against 16 vocabulary rows
packed per tile. Measured on the 2-core AVX2 machine (Zen 3), vocabulary 49,152, float32, ms,
best / median of 10-12 runs, kernel (the previous kernel: 3 x 4 dot-product tiles, static
split) vs sliced:

=========  =====  ===============  ===============  ===============
hidden     rows   kernel           previous         sliced
=========  =====  ===============  ===============  ===============
64         16     0.79 / 1.01      2.28 / 2.47      4.62 / 5.90
64         64     2.66 / 3.51      6.11 / 9.19      9.13 / 12.69
64         256    11.08 / 12.27    31.10 / 31.57    24.98 / 26.86
576        1      4.08 / 4.98      4.18 / 5.81      10.50 / 12.26
576        16     6.57 / 6.95      13.33 / 13.82    26.82 / 28.06
576        32     11.23 / 12.14    22.09 / 22.54    27.94 / 30.57
576        64     19.78 / 23.03    36.41 / 41.06    41.42 / 43.76
576        128    38.19 / 50.62    57.31 / 79.63    63.77 / 77.84
=========  =====  ===============  ===============  ===============

256 rows at hidden 64 is 1.6 GFLOP: 11 ms is ~145 GFLOP/s, near the two cores' FMA peak. The
kernel is ahead at every shape measured (1-1,024 rows; hidden 64, 576, 2,048), hence no row
limit. With a busy Python thread on one core, 256 rows at hidden 64 took 21-23 ms (previous
kernel 55-61; the slices, which take the GIL between ops, 0.7-1 s). Its sums run in another
order than MKL's, so a near tie (logits within float32 rounding) may go the other way.
``ASYNCENGINE_CPU_KERNELS=0`` turns it off with the other own kernels.

Before it, on AVX-512 VNNI CPUs, the int8 screen (``greedy_head_int8.py``) settles most rows
with the exact argmax; measured on 2 Zen 4 cores (AVX-512), vocabulary 49,152, hidden 64, ms,
best / median of 10, float kernel vs screen: 16 rows 0.57 / 0.59 vs 0.22 / 0.22; 64 rows
1.94 / 2.01 vs 0.79 / 0.82; 256 rows 7.87 / 7.96 vs 3.20 / 3.30.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels.build import load
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.sampler.greedy_head_int8 import greedy_int8

#: Vocabulary slice per matmul: [rows, SLICE] float32 stays within a core's L2 for 64 rows.
SLICE = 4096
#: Fewer rows than this take the plain path (their logits are small enough already).
MIN_ROWS = 16
#: Float32 rows go through the C++ kernel (faster than the slices at every measured shape);
#: False forces the slices, for comparisons.
KERNEL = True

_KERNEL_ARGS = ("const float*", "const float*", "const float*", "int64_t*", "int64_t", "int64_t",
                "int64_t", "int64_t", "int64_t")


def greedy_from_hidden(hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, slice_size: int = SLICE,
                       no_token: int = -1, screen: bool = True) -> torch.Tensor:
    """``argmax(hidden @ weight.T + bias, dim=-1)`` for hidden ``[N, H]``, weight ``[V, H]``:
    int64 ``[N]``, ``no_token`` for rows whose best logit is not finite.

    Per slice, the rows' maxima come from ``amax`` (a vectorized reduction, an order of
    magnitude cheaper than ``max`` with indices); only the rows whose maximum improves on
    their best so far look for its index, in the same buffer, so every value compared is the
    one the full matmul would give."""
    n, vocab = hidden.shape[0], weight.shape[0]
    screened = greedy_int8(hidden, weight, bias, no_token) if screen and KERNEL else None
    if screened is not None:  # the int8 screen (greedy_head_int8.py)
        ids, flagged = screened
        rows = flagged.nonzero().squeeze(1)
        if len(rows):
            ids[rows] = greedy_from_hidden(hidden[rows], weight, bias, slice_size=slice_size,
                                           no_token=no_token, screen=False)
        return ids
    if (KERNEL and layer_ops.ENABLED and hidden.dtype == weight.dtype == torch.float32
            and on_host(hidden) and (bias is None or bias.dtype == torch.float32)
            and (fn := load("greedy_head", _KERNEL_ARGS)) is not None):
        ids = torch.empty(n, dtype=torch.long)
        fn(hidden.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None
           else weight, ids, n, hidden.shape[1], vocab, int(bias is not None), no_token)
        return ids
    buf = torch.empty(n, min(slice_size, vocab), dtype=hidden.dtype, device=hidden.device)
    best = torch.full((n,), float("-inf"), dtype=buf.dtype, device=hidden.device)
    best_ids = torch.zeros(n, dtype=torch.long, device=hidden.device)
    for start in range(0, vocab, slice_size):
        end = min(start + slice_size, vocab)
        out = buf[:, :end - start]
        if bias is None:
            torch.mm(hidden, weight[start:end].t(), out=out)
        else:
            out.copy_(F.linear(hidden, weight[start:end], bias[start:end]))
        values = out.amax(dim=-1)
        # Strictly greater keeps the earlier slice on ties; a NaN wins once, then stays.
        better = (values > best) | (values.isnan() & ~best.isnan())
        rows = better.nonzero().squeeze(1)
        if len(rows) == n:
            best, best_ids = values, out.argmax(dim=-1) + start
        elif len(rows):
            best[rows] = values[rows]
            best_ids[rows] = out.index_select(0, rows).argmax(dim=-1) + start
    return torch.where(torch.isfinite(best), best_ids, no_token)
