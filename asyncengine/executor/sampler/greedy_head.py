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

Below ``KERNEL_ROWS`` float32 rows an own C++ kernel (``kernels/greedy_head.cpp``) does the
matmul and the argmax together, in registers: MKL's sgemm is weak at a few rows against a
narrow hidden size. Measured on the 2-core AVX2 machine, vocabulary 49,152, best of ten, ms:
hidden 64: 16 rows 1.8-2.4 (sliced 5.0-6.3), 64 rows 8.7-8.8 (13.6-14.1), 256 rows 31.1-31.3
(22.5-32.1, so the slices keep that size); hidden 576: 16 rows 14.4 (27.5), 32 rows 23.7
(40.6), 64 rows 36.5 (47.8), 128 rows 74.8 (92.9). Its sums run in another order than MKL's,
so a near tie (logits within float32 rounding) may go the other way.
``ASYNCENGINE_CPU_KERNELS=0`` turns it off with the other own kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels.build import load

#: Vocabulary slice per matmul: [rows, SLICE] float32 stays within a core's L2 for 64 rows.
SLICE = 4096
#: Fewer rows than this take the plain path (their logits are small enough already).
MIN_ROWS = 16
#: Fewer float32 rows than this go through the C++ kernel.
KERNEL_ROWS = 192

_KERNEL_ARGS = ("const float*", "const float*", "const float*", "int64_t*", "int64_t", "int64_t",
                "int64_t", "int64_t", "int64_t")


def greedy_from_hidden(hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, slice_size: int = SLICE,
                       no_token: int = -1) -> torch.Tensor:
    """``argmax(hidden @ weight.T + bias, dim=-1)`` for hidden ``[N, H]``, weight ``[V, H]``:
    int64 ``[N]``, ``no_token`` for rows whose best logit is not finite.

    Per slice, the rows' maxima come from ``amax`` (a vectorized reduction, an order of
    magnitude cheaper than ``max`` with indices); only the rows whose maximum improves on
    their best so far look for its index, in the same buffer, so every value compared is the
    one the full matmul would give."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if (n < KERNEL_ROWS and layer_ops.ENABLED and hidden.dtype == weight.dtype == torch.float32
            and hidden.device.type == "cpu" and (bias is None or bias.dtype == torch.float32)
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
