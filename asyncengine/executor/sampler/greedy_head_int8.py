"""Greedy tokens through an int8 screen of the vocabulary and an exact check of what is left.

The float32 head kernel (``kernels/greedy_head.cpp``) runs near the FMA peak of the cores, so
at many rows a step's greedy head costs what its FLOPs cost: 256 rows x 64 hidden x 49,152 ids
is 1.6 GFLOP, ~8 ms on two Zen 4 cores. AVX-512 VNNI multiplies int8 four times as fast. Here
the head is screened in int8 with a proven bound on its error, and only the ids that the bound
cannot rule out (a few per row) are computed exactly, in double, ties to the lowest id: the
result is the argmax of the exact logits, not of rounded ones (``kernels/greedy_head_int8.cpp``
derives the bound).

The weight is quantized once per head (per vocabulary row: a scale, the int8 row packed for
VNNI, its sum and the L1 norm of the float row), kept while the weight tensor is unchanged.
Used where the VNNI loop is compiled in (AVX-512 VNNI CPUs); elsewhere, for a weight that is
not finite, and for rows the screen flags (a non-finite input, more near-ties than it keeps),
the float32 kernel runs. The bound grows with the hidden size faster than the gaps between
the top logits do: at hidden 576 nearly every row is flagged, random heads and SmolLM2-135M's
own alike (its rows' largest elements set a quantization step too coarse for its logits), so
hidden sizes above 256 are not screened. A head whose rows are flagged more than 1 in 5 times
over its first 64 rows is no longer screened either, and its int8 copy is dropped.
Figures: sampler/greedy_head.py.
"""

from __future__ import annotations

import functools

import torch

from asyncengine.config import environment
from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels.build import load
from asyncengine.executor.kernels.where import on_host

#: ``ASYNCENGINE_GREEDY_INT8=0`` turns the screen off (comparisons).
ENABLED = environment.on("ASYNCENGINE_GREEDY_INT8")

_ARGS = ("const float*", "const float*", "const float*", "const int8_t*", "const float*",
         "const int32_t*", "const float*", "int64_t*", "int64_t*", "int64_t", "int64_t",
         "int64_t", "int64_t", "int64_t")


@functools.cache
def _kernel():
    return load("greedy_head_int8", _ARGS) if layer_ops.ENABLED else None


@functools.cache
def fast() -> bool:
    """Whether the AVX-512 VNNI screen is compiled in here."""
    fn = _kernel()
    if fn is None:
        return False
    flag = torch.zeros(1, dtype=torch.long)
    empty = torch.empty(0)
    fn(empty, empty, empty, torch.empty(0, dtype=torch.int8), empty,
       torch.empty(0, dtype=torch.int32), empty, flag, flag, 0, 0, 0, 0, 0)
    return bool(flag.item())


class Int8Head:
    """A head weight ``[V, K]`` float32 prepared for the screen (arrays padded to blocks of
    16 vocabulary rows; the kernel ignores the padding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        V, K = weight.shape
        if K % 4:
            raise ValueError(f"the int8 screen needs a hidden size divisible by 4, not {K}")
        self.source = (weight, weight._version, bias, None if bias is None else bias._version)
        self.finite = bool(torch.isfinite(weight).all()) and (
            bias is None or bool(torch.isfinite(bias).all()))
        Vp = (V + 15) // 16 * 16
        # A slice of rows at a time: no float copy of the whole head, even transiently.
        self.scale = torch.zeros(Vp, dtype=torch.float32)
        self.sum_q = torch.zeros(Vp, dtype=torch.int32)
        self.l1 = torch.zeros(Vp, dtype=torch.float32)
        q = torch.zeros(Vp, K, dtype=torch.int8)
        for start in range(0, V, PREPARE_ROWS):
            w = weight[start:start + PREPARE_ROWS].float()
            scale = w.abs().amax(dim=1) / 127
            qs = torch.where(scale[:, None] > 0, w / scale.clamp(min=1e-38)[:, None],
                             torch.zeros(())).round().clamp(-127, 127).to(torch.int8)
            end = start + len(w)
            q[start:end] = qs
            self.scale[start:end] = scale
            self.sum_q[start:end] = qs.sum(dim=1, dtype=torch.int32)
            self.l1[start:end] = w.double().abs().sum(dim=1).float()
        # [Vp, K] -> [Vp/16, K/4, 16, 4]: per block and 4 hidden elements, 16 rows' 4 bytes.
        self.packed = q.view(Vp // 16, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous()
        del q
        # Rows seen and rows flagged: a head whose rows mostly fall back (a bound too loose
        # for its logits' spread) stops being screened.
        self.rows = self.flagged = 0
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(Vp, dtype=torch.float32)
            self.bias[:V] = bias

    @property
    def useful(self) -> bool:
        return self.finite and (self.rows < PROBE_ROWS or self.flagged * 5 <= self.rows)

    def release(self) -> None:
        self.packed = self.scale = self.sum_q = self.l1 = self.bias = None

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        w, wv, b, bv = self.source
        return w is weight and wv == weight._version and b is bias and (
            bias is None or bv == bias._version)


#: Vocabulary rows quantized at a time when a head is prepared.
PREPARE_ROWS = 8192
#: The largest hidden size screened: the bound grows with it faster than the gaps between the
#: top logits do (at 576, random and real heads alike get nearly every row flagged).
MAX_HIDDEN = 256

#: Rows screened before a head's fallback rate decides whether it stays screened (above 1
#: in 5 it does not).
PROBE_ROWS = 64

_cache: list[Int8Head] = []  # the heads seen lately (one per model in practice)


def prepared(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Head:
    for head in _cache:
        if head.matches(weight, bias):
            return head
    head = Int8Head(weight, bias)
    _cache.insert(0, head)
    del _cache[4:]
    return head


def greedy_int8(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                no_token: int, *, force: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Ids ``[N]`` and fallback flags ``[N]`` (rows left to the float kernel), or None where
    the screen does not apply. ``force``: run even without VNNI (its portable loop; tests)."""
    if not (ENABLED and (force or fast()) and hidden.dtype == weight.dtype == torch.float32
            and on_host(hidden) and weight.shape[1] % 4 == 0
            and weight.shape[1] <= MAX_HIDDEN
            and (bias is None or bias.dtype == torch.float32)):
        return None
    fn = _kernel()
    if fn is None:
        return None
    head = prepared(weight, bias)
    if not head.useful:
        return None
    n, (vocab, k) = hidden.shape[0], weight.shape
    ids = torch.empty(n, dtype=torch.long)
    fallback = torch.empty(n, dtype=torch.long)
    w = weight.contiguous()
    fn(hidden.contiguous(), w, head.bias if head.bias is not None else head.scale,
       head.packed, head.scale, head.sum_q, head.l1, ids, fallback, n, k, vocab,
       int(bias is not None), no_token)
    head.rows += n
    head.flagged += int(fallback.sum())
    if not head.useful:
        head.release()
    return ids, fallback
