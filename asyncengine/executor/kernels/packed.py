"""CPU matmuls that read packed int4 / int8 weights directly, compiled at first use.

A decode step of a few requests streams every weight once, so on the CPU its cost is the bytes
of the weights: float32 SmolLM2-135M is 513 MB per token. Keeping a GGUF file's Q4_1 / Q8_0
blocks packed cuts that to ~90 MB, but only if the matmul reads them at memory speed.
PyTorch's own packed kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) are
vectorized for AVX-512 only; on an AVX2 CPU they run at ~1 GB/s, 10x slower than a float32
matmul. These kernels are written for AVX2 + FMA + F16C (with a plain C++ fallback for other
CPUs) and compiled with inductor's C++ toolchain, the one ``--compile`` already uses, so they
need nothing that torch does not bring. The C++ is in ``int4.cpp`` and ``int8.cpp``.

Layouts (``w[n, k]`` is the weight of output ``n`` and input ``k``):

- **int4** ``q``: uint8 ``[N, K / 2]``, blocks of 32 inputs: byte ``j`` of block ``b`` holds
  input ``32 b + j`` in its low nibble and ``32 b + 16 + j`` in its high nibble (the layout of
  GGUF's Q4_0 / Q4_1 quants). ``sm``: float16 ``[N, K / 32, 2]`` holding (scale, min) per
  block, ``w = q * scale + min`` with ``q`` in [0, 15]: Q4_1's ``d, m`` as stored, Q4_0's
  ``d, -8 d``.
- **int8** ``q``: int8 ``[N, K]``; ``scales``: float32 ``[N, K / group]``, ``w = q * scale``
  (GGUF's Q8_0 is ``group`` 32; per-channel int8 is ``group`` K).

How a call runs: the output rows are split across the OpenMP threads.

- int4, fewer than 8 input rows (decode, bound by reading the weights): the weights stay
  packed. The input rows are rounded to int8 per block of 32, twice (the value, then its
  rounding error at 1/256 of the step), so they are exact to ~1.5e-5 of the block maximum;
  a block then costs two byte dot products (``vpmaddubsw``) folded into one integer sum and
  one float FMA (``int4.cpp`` has the algebra).
- int4 from 8 rows on, and int8 always (bound by arithmetic): each weight row is dequantized
  into a float32 buffer that stays in L1 and multiplied in float32, exact activations; with
  several input rows two weight rows share each input load (a 2 x 4 tile of accumulators).

The weights are read once per call whatever the number of input rows. Results equal
``x @ dequant(w).T`` up to float32 summation order (int4 below 8 rows: up to the rounding of
the activations, ~1e-5 relative; ``tests/executor/test_int4.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncengine.executor.kernels import build

GROUP = 32

# Input widths the kernels take: whole blocks, whole AVX2 vectors, and a row buffer of 16384.
MAX_K = 16384


_ARGS = {
    "int4": ("const float*", "const uint8_t*", "const uint16_t*", "float*", "int64_t", "int64_t",
             "int64_t"),
    "int8": ("const float*", "const int8_t*", "const float*", "float*", "int64_t", "int64_t",
             "int64_t", "int64_t"),
    "int4_bf16": ("const uint16_t*", "const uint8_t*", "const uint16_t*", "float*", "int64_t",
                  "int64_t", "int64_t"),
    "int8_bf16": ("const uint16_t*", "const int8_t*", "const float*", "float*", "int64_t",
                  "int64_t", "int64_t", "int64_t"),
    "int4_tile8": ("const uint16_t*", "const uint8_t*", "const uint16_t*", "uint16_t*",
                   "int64_t", "int64_t", "int64_t"),
    "int8_tile8": ("const uint16_t*", "const int8_t*", "const float*", "float*", "int64_t",
                   "int64_t", "int64_t", "int64_t"),
    "int4_dequant": ("const uint8_t*", "const uint16_t*", "ae_t*", "int64_t", "int64_t"),
    "kquant": ("const float*", "const uint8_t*", "float*", "int64_t", "int64_t", "int64_t",
               "int64_t", "int64_t"),
    "kquant_dequant": ("const uint8_t*", "const int64_t*", "ae_t*", "int64_t", "int64_t",
                       "int64_t"),
}


_LOADED: dict[tuple[str, int], Callable[..., None] | None] = {}


def _load(name: str, dtype_code: int = 0) -> Callable[..., None] | None:
    """The compiled kernel ``name`` (int4, int8, int4_dequant, kquant, kquant_dequant:
    ``<name>.cpp``; ``dtype_code``: kquant_dequant's output type, build.DTYPE_CODES), or
    None."""
    key = (name, dtype_code)
    fn = _LOADED.get(key)
    if fn is None and key not in _LOADED:
        fn = _LOADED[key] = build.load(name, _ARGS[name],
                                       dtype_code if "ae_t*" in _ARGS[name] else None)
    return fn


def available(name: str) -> bool:
    """Whether the ``name`` kernel (int4, int8) builds on this machine (compiles it once)."""
    return _load(name) is not None


def supports(in_features: int, group: int = GROUP) -> bool:
    return (in_features % group == 0 and in_features % 16 == 0 and in_features <= MAX_K)


def int4_mm(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """``x [M, K] float32 @ dequant(q, sm).T`` -> ``[M, N]`` (int4 layout above)."""
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, q.shape[0], dtype=torch.float32)
    _load("int4")(x, q, sm, out, m, q.shape[0], k)
    return out


_BF16_PATH: dict[str, bool] = {}


def bf16_available(name: str = "int4_bf16") -> bool:
    """Whether kernel ``name`` (int4_bf16, int8_bf16: AVX-512 BF16; int4_tile8, int8_tile8:
    AVX-512 VNNI and BITALG) runs here: its instructions compiled in (asked once, by a call
    with no rows: the kernel then writes a nonzero flag)."""
    ok = _BF16_PATH.get(name)
    if ok is None:
        fn = _load(name)
        ok = False
        if fn is not None:
            flag = torch.zeros(1, dtype=torch.int32)
            fn(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.uint8),
               torch.zeros(1), flag, 0, 0, 0,
               *((0,) if name in ("int8_bf16", "int8_tile8") else ()))
            ok = bool(flag.item())
        _BF16_PATH[name] = ok
    return ok


def int4_bf16_available() -> bool:
    return bf16_available("int4_bf16")


def int4_tile8_available() -> bool:
    return bf16_available("int4_tile8")


def _int4_rows_mm(name: str, x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, q.shape[0], dtype=dtype)
    _load(name)(x, q, sm, out, m, q.shape[0], k)
    return out


def int4_tile8_mm(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """``x [M, K] bfloat16 @ dequant(q, sm).T`` -> bfloat16 ``[M, N]`` by byte dot products,
    the activations rounded to int8 per block of 32 (``int4_tile8.cpp``; check
    ``int4_tile8_available()`` first)."""
    return _int4_rows_mm("int4_tile8", x, q, sm, torch.bfloat16)


def int8_bf16_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] bfloat16 @ (q * scales).T`` -> float32 ``[M, N]``, ``scales [N, 1]`` (per
    channel) or ``[N, K / 32]`` (per block), K a multiple of 64 (``int8_bf16.cpp``; check
    ``bf16_available("int8_bf16")`` first)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    _load("int8_bf16")(x, q, scales, out, x.shape[0], q.shape[0], x.shape[1],
                       scales.shape[1])
    return out


def int8_tile8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] bfloat16 @ (q * scales).T`` -> float32 ``[M, N]`` by byte dot products, the
    activations rounded to int8 per block of 32 (``int8_tile8.cpp``; scales as
    ``int8_bf16_mm``'s; check ``bf16_available("int8_tile8")`` first)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    _load("int8_tile8")(x, q, scales, out, x.shape[0], q.shape[0], x.shape[1],
                        scales.shape[1])
    return out


def int4_bf16_mm(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """``x [M, K] bfloat16 @ bf16(dequant(q, sm)).T`` -> float32 ``[M, N]``, K a multiple of
    64 (``int4_bf16.cpp``: each row's result independent of M; check
    ``int4_bf16_available()`` first)."""
    return _int4_rows_mm("int4_bf16", x, q, sm, torch.float32)


def int4_dequant(q: torch.Tensor, sm: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights ``[N, K]`` of ``q, sm`` (int4 layout above) as ``dtype`` (float32, or
    bfloat16: the float32 values rounded once, as ``.to(torch.bfloat16)``), in one pass."""
    n, k = q.shape[0], q.shape[1] * 2
    w = torch.empty(n, k, dtype=dtype)
    _load("int4_dequant", build.DTYPE_CODES[dtype])(q.contiguous(), sm.contiguous(), w, n, k)
    return w


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] float32 @ (q * scales).T`` -> ``[M, N]`` (int8 layout above)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    _load("int8")(x, q, scales, out, x.shape[0], q.shape[0], x.shape[1],
                  x.shape[1] // scales.shape[1])
    return out


def kquant_mm(x: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """``out[:, :N] = x [M, K] float32 @ dequant(w).T`` for a GGUF matrix ``w`` (uint8
    ``[N, row bytes]`` as the file stores it, GGML type ``qtype``; ``kquant.cpp``). ``out``
    may be a column slice of a wider float32 matrix (its row stride is passed on). ``x``
    may be bfloat16 (contiguous), and ``out`` too: they go in as they are, flagged."""
    m, k = x.shape
    if x.dtype == torch.bfloat16:
        qtype |= KQ_X_BF16
    if out.dtype == torch.bfloat16:
        qtype |= KQ_OUT_BF16
    _load("kquant")(x, w, out, m, w.shape[0], k, out.stride(0), qtype)


# A flag on ``kquant_mm``'s type: from ``kquants.TILE_ROWS`` rows, the bfloat16 tiles
# (``kquant_tile.h``) even for the types ``kquant_tile8.h`` takes (tests check both).
KQ_BF16_TILES = 0x100
# A flag on ``kquant_mm``'s type: ``x`` is bfloat16 (``kquant_tile8.h`` rounds it to int8 as it
# is, no float32 copy; any other path widens it first).
KQ_X_BF16 = 0x200
# ... and ``out`` bfloat16 (``kquant_tile8.h`` rounds its sums once, as ``.to(bfloat16)``).
KQ_OUT_BF16 = 0x400
# A flag on ``kquant_mm``'s type: ``kquant_tile8.h`` from 3 rows instead of ``TILE_ROWS`` (a
# row's result then depends on the row count below ``TILE_ROWS``; ``kquants.use_few_row_tiles``).
KQ_TILE8_FEW = 0x800

_KQ_ASKED: dict[int, bool] = {}


def _kquant_has(ask: int) -> bool:
    """``kquant.cpp``'s answer to a call with type ``ask`` (out[0] 1 or 0), asked once."""
    if ask not in _KQ_ASKED:
        fn = _load("kquant")
        flag = torch.zeros(1)
        if fn is not None:
            fn(torch.zeros(1), torch.zeros(1, dtype=torch.uint8), flag, 0, 0, 0, 0, ask)
        _KQ_ASKED[ask] = bool(flag.item())
    return _KQ_ASKED[ask]


def kquant_bf16_tile() -> bool:
    """Whether ``kquant.cpp`` multiplies from ``kquants.TILE_ROWS`` input rows in place
    (``kquant_tile.h``: AVX-512 BF16 compiled in)."""
    return _kquant_has(-1)


def kquant_int8_tile() -> bool:
    """Whether ``kquant.cpp`` takes the blocks of 32 and the k-quants from
    ``kquants.TILE_ROWS`` rows by ``kquant_tile8.h``'s byte dot products (AVX-512 BF16, VNNI
    and BITALG compiled in), at any row count (row panels)."""
    return _kquant_has(-2)


def kquant_dequant(w: torch.Tensor, ids: torch.Tensor, k: int, qtype: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (int64) of a GGUF matrix ``w`` as ``[len(ids), k]`` of ``dtype`` (float32
    or bfloat16), bit-exact with ``gguf.quants.dequantize`` (then ``.to(dtype)``;
    ``kquant_dequant.cpp``)."""
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    _load("kquant_dequant", build.DTYPE_CODES[dtype])(w, ids.contiguous(), out, ids.shape[0],
                                                      k, qtype)
    return out


@torch.library.custom_op("asyncengine::int4_mm", mutates_args=())
def _int4_mm_op(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    return int4_mm(x, q, sm)


@_int4_mm_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("asyncengine::int8_mm", mutates_args=())
def _int8_mm_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return int8_mm(x, q, scales)


@_int8_mm_op.register_fake
def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0], dtype=torch.float32)


def int4_linear(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """``int4_mm`` for a model's forward: a direct call when eager (a custom op's dispatch
    costs ~10 us, a lot next to a 50 us matmul), the registered op under ``torch.compile``."""
    if torch.compiler.is_compiling():
        return torch.ops.asyncengine.int4_mm(x, q, sm)
    return int4_mm(x, q, sm)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``int8_mm`` for a model's forward (see ``int4_linear``)."""
    if torch.compiler.is_compiling():
        return torch.ops.asyncengine.int8_mm(x, q, scales)
    return int8_mm(x, q, scales)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] values in [0, 15] -> uint8 [N, K / 2] in the int4 layout."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // GROUP, 2, GROUP // 2)  # [N, B, lo/hi, 16]
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: uint8 [N, K / 2] -> uint8 [N, K] in [0, 15]."""
    n, half = packed.shape
    b = packed.view(n, half // 16, 1, 16)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)
