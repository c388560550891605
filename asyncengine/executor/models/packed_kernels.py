"""CPU matmuls that read packed int4 / int8 weights directly, compiled at first use.

A decode step of a few requests streams every weight once, so on the CPU its cost is the bytes
of the weights: float32 SmolLM2-135M is 513 MB per token. Keeping a GGUF file's Q4_1 / Q8_0
blocks packed cuts that to ~90 MB, but only if the matmul reads them at memory speed.
PyTorch's own packed kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) are
vectorized for AVX-512 only; on an AVX2 CPU they run at ~1 GB/s, 10x slower than a float32
matmul. These kernels are written for AVX2 + FMA + F16C (with a plain C++ fallback for other
CPUs) and compiled with inductor's C++ toolchain, the one ``--compile`` already uses, so they
need nothing that torch does not bring.

Layouts (``w[n, k]`` is the weight of output ``n`` and input ``k``):

- **int4** ``q``: uint8 ``[N, K / 2]``, blocks of 32 inputs: byte ``j`` of block ``b`` holds
  input ``32 b + j`` in its low nibble and ``32 b + 16 + j`` in its high nibble (the layout of
  GGUF's Q4_0 / Q4_1 quants). ``sm``: float16 ``[N, K / 32, 2]`` holding (scale, min) per
  block, ``w = q * scale + min`` with ``q`` in [0, 15]: Q4_1's ``d, m`` as stored, Q4_0's
  ``d, -8 d``.
- **int8** ``q``: int8 ``[N, K]``; ``scales``: float32 ``[N, K / group]``, ``w = q * scale``
  (GGUF's Q8_0 is ``group`` 32; per-channel int8 is ``group`` K).

How a call runs: the output rows are split across the OpenMP threads. A thread dequantizes
one weight row into a float32 buffer that stays in L1, then takes its dot product with every
input row, four input rows at a time so each loaded weight vector feeds four FMAs. The weights
are read once per call whatever the number of input rows; the arithmetic is the float32
matmul's. Results equal ``x @ dequant(w).T`` up to float32 summation order.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

GROUP = 32

_COMMON = r"""
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AE_AVX2 1
#endif

static inline float ae_half(uint16_t h) {
#ifdef AE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000 | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; std::memcpy(&f, &bits, 4); return f;
#endif
}

// out[m * N + n] = dot(w, x[m]) for m in [0, M); w: K floats, x: [M, K].
static inline void ae_dots(const float* w, const float* x, float* out, int64_t M, int64_t N,
                           int64_t K) {
    int64_t m = 0;
#ifdef AE_AVX2
    for (; m + 4 <= M; m += 4) {
        const float* x0 = x + m * K; const float* x1 = x0 + K;
        const float* x2 = x1 + K; const float* x3 = x2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 wv = _mm256_loadu_ps(w + k);
            a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + k), a0);
            a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + k), a1);
            a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2 + k), a2);
            a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3 + k), a3);
        }
        // Horizontal sums of the four accumulators at once.
        __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
        __m256 s = _mm256_hadd_ps(s01, s23);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        float t[4]; _mm_storeu_ps(t, r);
        out[m * N] = t[0]; out[(m + 1) * N] = t[1];
        out[(m + 2) * N] = t[2]; out[(m + 3) * N] = t[3];
    }
    for (; m < M; ++m) {
        const float* xm = x + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xm + k + 8), a1);
        }
        for (; k < K; k += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), a0);
        __m256 a = _mm256_add_ps(a0, a1);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        r = _mm_hadd_ps(r, r); r = _mm_hadd_ps(r, r);
        out[m * N] = _mm_cvtss_f32(r);
    }
#else
    for (; m < M; ++m) {
        const float* xm = x + m * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += w[k] * xm[k];
        out[m * N] = acc;
    }
#endif
}
"""

_INT4 = _COMMON + r"""
// One weight row n against input rows [m0, m0 + MC): MC accumulators stay in registers.
template <int MC>
static inline void ae_q4_row(const uint8_t* qn, const uint16_t* smn, const int8_t* xq,
                             const int8_t* xr, const float* xd, const float* xe,
                             const float* xsum, float* out, int64_t m0, int64_t n, int64_t N,
                             int64_t blocks) {
    float minacc[MC];
    for (int i = 0; i < MC; ++i) minacc[i] = 0.f;
#ifdef AE_AVX2
    __m256 acc[MC];
    for (int i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const float scale = ae_half(smn[2 * b]), mn = ae_half(smn[2 * b + 1]);
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(qn + 16 * b));
        const __m256i w = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
        #pragma GCC unroll 4
        for (int i = 0; i < MC; ++i) {
            const int64_t xb = (m0 + i) * blocks + b;
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + xb * 32));
            const __m256i rv = _mm256_loadu_si256((const __m256i*)(xr + xb * 32));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
            const __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(w, rv), ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale * xd[xb]),
                                     acc[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pr), _mm256_set1_ps(scale * xe[xb]),
                                     acc[i]);
            minacc[i] += mn * xsum[xb];
        }
    }
    for (int i = 0; i < MC; ++i) {
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        r = _mm_hadd_ps(r, r); r = _mm_hadd_ps(r, r);
        out[(m0 + i) * N + n] = _mm_cvtss_f32(r) + minacc[i];
    }
#else
    for (int i = 0; i < MC; ++i) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t xb = (m0 + i) * blocks + b;
            const uint8_t* qb = qn + 16 * b;
            const int8_t* xqb = xq + xb * 32;
            const int8_t* xrb = xr + xb * 32;
            int32_t s = 0, r = 0;
            for (int j = 0; j < 16; ++j) {
                s += (int32_t)(qb[j] & 0x0f) * xqb[j] + (int32_t)(qb[j] >> 4) * xqb[16 + j];
                r += (int32_t)(qb[j] & 0x0f) * xrb[j] + (int32_t)(qb[j] >> 4) * xrb[16 + j];
            }
            acc += (float)s * ae_half(smn[2 * b]) * xd[xb];
            acc += (float)r * ae_half(smn[2 * b]) * xe[xb];
            minacc[i] += ae_half(smn[2 * b + 1]) * xsum[xb];
        }
        out[(m0 + i) * N + n] = acc + minacc[i];
    }
#endif
}

// Activations are rounded to int8 per block of 32 inputs, as llama.cpp does for its Q4 x Q8
// dot products, so a block costs byte multiply-adds instead of 32 float FMAs. Unlike llama.cpp
// the rounding error is rounded to int8 again (x ~= xq * d + xr * e, e <= d / 254): two byte
// dot products per block, and the activations are exact to ~1e-4 of their block maximum.
// x: float [M, K]; q: uint8 [N, K/2]; sm: float16 [N, K/32, 2]; out: float [M, N];
// xq: int8 [2, M, K] and xd: float [3, M, K/32] scratch (the two roundings; d, e, sums).
// From this many input rows on, a call is bound by arithmetic, not by reading the weights:
// each weight row is dequantized once into L1 and multiplied in float32 (exact activations).
#define AE_FLOAT_ROWS 8

extern "C" void kernel(const float* x, const uint8_t* q, const uint16_t* sm, float* out,
                       int8_t* xq, float* xd, int64_t M, int64_t N, int64_t K) {
    const int64_t blocks = K / 32;
    int8_t* xr = xq + M * K;
    float* xe = xd + M * blocks;
    float* xsum = xe + M * blocks;
    for (int64_t i = 0; i < (M < AE_FLOAT_ROWS ? M * blocks : 0); ++i) {
        const float* xb = x + i * 32;
        float amax = 0.f, sum = 0.f, res[32];
        for (int j = 0; j < 32; ++j) { amax = std::max(amax, std::fabs(xb[j])); sum += xb[j]; }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        float rmax = 0.f;
        for (int j = 0; j < 32; ++j) {
            const float r = std::nearbyint(xb[j] * inv);
            xq[i * 32 + j] = (int8_t)r;
            res[j] = xb[j] - r * d;
            rmax = std::max(rmax, std::fabs(res[j]));
        }
        const float e = rmax / 127.f, einv = e > 0.f ? 1.f / e : 0.f;
        for (int j = 0; j < 32; ++j) xr[i * 32 + j] = (int8_t)std::nearbyint(res[j] * einv);
        xd[i] = d; xe[i] = e; xsum[i] = sum;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* qn = q + n * (K / 2);
        const uint16_t* smn = sm + n * blocks * 2;
        if (M >= AE_FLOAT_ROWS) {  // compute-bound: dequantize the row once, float dots
            alignas(64) float wbuf[16384];
            for (int64_t b = 0; b < blocks; ++b) {
                const float scale = ae_half(smn[2 * b]), mn = ae_half(smn[2 * b + 1]);
                const uint8_t* qb = qn + 16 * b;
                for (int j = 0; j < 16; ++j) {
                    wbuf[32 * b + j] = (float)(qb[j] & 0x0f) * scale + mn;
                    wbuf[32 * b + 16 + j] = (float)(qb[j] >> 4) * scale + mn;
                }
            }
            ae_dots(wbuf, x, out + n, M, N, K);
            continue;
        }
        // Two input rows per pass: 2 x 2 accumulating planes keep to the 16 AVX2 registers.
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2)
            ae_q4_row<2>(qn, smn, xq, xr, xd, xe, xsum, out, m0, n, N, blocks);
        if (m0 < M) ae_q4_row<1>(qn, smn, xq, xr, xd, xe, xsum, out, m0, n, N, blocks);
    }
}
"""

_INT8 = _COMMON + r"""
// x: float [M, K]; q: int8 [N, K]; scales: float [N, K/group]; out: float [M, N].
extern "C" void kernel(const float* x, const int8_t* q, const float* scales, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    #pragma omp parallel
    {
        alignas(64) float wbuf[16384];
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const int8_t* qn = q + n * K;
            const float* sn = scales + n * groups;
            for (int64_t g = 0; g < groups; ++g) {
                const float scale = sn[g];
                const int64_t k0 = g * group;
#ifdef AE_AVX2
                const __m256 s = _mm256_set1_ps(scale);
                for (int64_t k = k0; k < k0 + group; k += 8) {
                    __m128i b = _mm_loadl_epi64((const __m128i*)(qn + k));
                    _mm256_storeu_ps(wbuf + k, _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
                }
#else
                for (int64_t k = k0; k < k0 + group; ++k) wbuf[k] = (float)qn[k] * scale;
#endif
            }
            ae_dots(wbuf, x, out + n, M, N, K);
        }
    }
}
"""

# Input widths the kernels take: whole blocks, whole AVX2 vectors, and a row buffer of 16384.
MAX_K = 16384


@functools.cache
def _load(name: str) -> Callable[..., None] | None:
    """The compiled kernel ``name`` (int4, int8), or None where it cannot be built here."""
    if name == "int4":
        source, args = _INT4, ["const float*", "const uint8_t*", "const uint16_t*", "float*",
                               "int8_t*", "float*", "int64_t", "int64_t", "int64_t"]
    else:
        source, args = _INT8, ["const float*", "const int8_t*", "const float*", "float*",
                               "int64_t", "int64_t", "int64_t", "int64_t"]
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(args, source)
    except Exception as exc:  # no compiler, an unsupported platform: the caller falls back
        logger.warning("the packed %s CPU kernel could not be built (%s: %s); packed layers "
                       "compute with dequantized weights", name, type(exc).__name__, exc)
        return None


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
    xq = torch.empty(2, m, k, dtype=torch.int8)
    xd = torch.empty(3, m, k // GROUP, dtype=torch.float32)
    _load("int4")(x, q, sm, out, xq, xd, m, q.shape[0], k)
    return out


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] float32 @ (q * scales).T`` -> ``[M, N]`` (int8 layout above)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
    _load("int8")(x, q, scales, out, x.shape[0], q.shape[0], x.shape[1],
                  x.shape[1] // scales.shape[1])
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
