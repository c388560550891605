// Float dot products and horizontal sums shared by the matmul kernels.
#pragma once
#include "floats.h"

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

// out[m * N] = dot(w0, x[m]) and out[m * N + 1] = dot(w1, x[m]) for m in [0, M): two
// weight rows share each input load, a 2 x 4 tile of accumulators (the compute-bound case,
// many input rows: 6 loads per 8 FMAs where one row at a time needs 5 per 4).
static inline void ae_dots2(const float* w0, const float* w1, const float* x, float* out,
                            int64_t M, int64_t N, int64_t K) {
#ifdef AE_AVX2
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const float* xr[4] = {x + m * K, x + (m + 1) * K, x + (m + 2) * K, x + (m + 3) * K};
        __m256 a[4], b[4];
        for (int i = 0; i < 4; ++i) { a[i] = _mm256_setzero_ps(); b[i] = _mm256_setzero_ps(); }
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 wa = _mm256_loadu_ps(w0 + k), wb = _mm256_loadu_ps(w1 + k);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                const __m256 xv = _mm256_loadu_ps(xr[i] + k);
                a[i] = _mm256_fmadd_ps(wa, xv, a[i]);
                b[i] = _mm256_fmadd_ps(wb, xv, b[i]);
            }
        }
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                          _mm256_permute2f128_ps(u0, u1, 0x31)));
        for (int i = 0; i < 4; ++i) { out[(m + i) * N] = t[i]; out[(m + i) * N + 1] = t[4 + i]; }
    }
    if (m < M) {
        ae_dots(w0, x + m * K, out + m * N, M - m, N, K);
        ae_dots(w1, x + m * K, out + m * N + 1, M - m, N, K);
    }
#else
    ae_dots(w0, x, out, M, N, K);
    ae_dots(w1, x, out + 1, M, N, K);
#endif
}

#if defined(__AVX512F__)
// Lane i = the sum of v[i]'s 16 lanes, for 16 vectors (a transposed reduction instead of 16
// horizontal ones): halves, quarters, pairs and lanes added two vectors at a time (30
// shuffles, 15 adds), then one permutation into order.
static inline __m512 ae_sum16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1: v[2i]'s, 2-3: v[2i + 1]'s
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; ++i)  // lane k: v[4i + k]'s
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; ++i)  // lane k, elements 0-1: v[8i + k]'s, 2-3: v[8i + 4 + k]'s
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88),  // lane k, element e:
                                   _mm512_shuffle_ps(c[0], c[1], 0xdd));  // sum(v[4e + k])
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, d);
}
#endif

#if defined(__AVX512F__)
// 16 vectors' horizontal sums at once: lane j of the result is _mm512_reduce_add_ps(v[s]) for
// the slot s = AE_SLOT16(j), bit for bit: the same additions in the same tree as GCC's reduction
// of each vector alone (lanes i + (i + 8), then i + (i + 4), then (0 + 2) and (1 + 3), then
// those two), since a float addition commutes exactly. 30 shuffles and 15 additions for 16
// sums, where 16 reductions take ~7 operations each. For the kernels whose lanes run along K
// (int4_bf16.cpp, int8_bf16.cpp): a row's result is the same whether its weight row is
// reduced alone or in a group of 16.
#define AE_SLOT16(j) ((((j) % 4) * 4) + (j) / 4)
static inline __m512 ae_reduce16(const __m512* v) {
    __m512 l1[8], l2[4], l3[2];
    for (int p = 0; p < 8; ++p)  // two vectors' halves, added, to a vector
        l1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE),
                              _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44));
    for (int q = 0; q < 4; ++q)  // four vectors' quarters
        l2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * q], l1[2 * q + 1], 0xDD),
                              _mm512_shuffle_f32x4(l1[2 * q], l1[2 * q + 1], 0x88));
    for (int r = 0; r < 2; ++r)  // lanes 0 + 2 and 1 + 3 of each quarter
        l3[r] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * r], l2[2 * r + 1], 0x44),
                              _mm512_shuffle_ps(l2[2 * r], l2[2 * r + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88),
                         _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
}
#endif

