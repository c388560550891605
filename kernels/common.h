// Shared by the CPU kernels of this folder: ISA detection, float16, float dot products.
#pragma once
#include <Python.h>  // first, as Python asks; for AeWithoutGil
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <new>
#include <vector>
// Scratch buffers start on a cache line: the kernels read them with unaligned vector loads, and
// a 64-byte load that straddles two lines costs more. malloc's 16-byte alignment left that to
// chance, per process and per buffer size: int4_bf16.cpp's reordered rows at 16 / 32 / 48 bytes
// past a line made a 6-row SmolLM2 3072 x 576 matmul 63 us against 49 us (M = 1 unaffected).
template <class T>
struct AeAlign64 {
    using value_type = T;
    AeAlign64() = default;
    template <class U>
    AeAlign64(const AeAlign64<U>&) {}
    T* allocate(std::size_t n) {
        return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    }
    void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <class U>
    bool operator==(const AeAlign64<U>&) const { return true; }
    template <class U>
    bool operator!=(const AeAlign64<U>&) const { return false; }
};
template <class T>
using ae_vec = std::vector<T, AeAlign64<T>>;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AE_AVX2 1
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

// OpenMP, or one thread without it: the calls a kernel's parallel region makes.
static inline int64_t ae_max_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static inline int64_t ae_thread_num() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static inline int64_t ae_team_size() {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

// The GIL released for a long call (a millisecond or more), when `release` and the calling
// thread holds it (a kernel called from another kernel's call has it released already): the
// event loop's thread runs Python meanwhile instead of waiting for this call to return.
struct AeWithoutGil {
    PyThreadState* state;
    explicit AeWithoutGil(bool release = true)
        : state(release && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
    ~AeWithoutGil() { if (state) PyEval_RestoreThread(state); }
};
// Weights of at least this many elements make a matmul long enough to release the GIL.
#define AE_RELEASE_GIL_ELEMENTS (1 << 22)

// Software prefetch in the row kernels (int4_bf16.cpp, int8_bf16.cpp) when two or more input
// rows share each pass over a weight row: the weights AE_PREFETCH_ROWS rows ahead. With one
// row the loop is short enough for the hardware prefetcher; with more, each weight line is
// worked on longer and its stream falls behind: a decode step's weights come from memory, not
// the cache, and a 9-row verification step waited on them (a 1 + 8 row step of SmolLM2: its
// gate_up / down matmuls 98 / 55 -> 71 / 36 us a layer, the int8 head 1.27 -> 0.88 ms; the
// step 10.1 -> 8.4 ms, decode_step.py --drafts 8). Prefetches change no result.
#define AE_PREFETCH_ROWS 8

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

// ---- Element types of the layer kernels: AE_DTYPE 0 = float32, 1 = bfloat16 (stored as
// uint16_t). Arithmetic is float32; a bfloat16 result is rounded to nearest even once.
#ifndef AE_DTYPE
#define AE_DTYPE 0
#endif
#if AE_DTYPE == 0
typedef float ae_t;
static inline float ae_get(const ae_t* p) { return *p; }
static inline void ae_put(ae_t* p, float v) { *p = v; }
#else
typedef uint16_t ae_t;
static inline float ae_get(const ae_t* p) {
    uint32_t bits = (uint32_t)(*p) << 16; float f; std::memcpy(&f, &bits, 4); return f;
}
static inline void ae_put(ae_t* p, float v) {
    uint32_t bits; std::memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) { *p = (uint16_t)((bits >> 16) | 0x40); return; }
    bits += 0x7fff + ((bits >> 16) & 1);
    *p = (uint16_t)(bits >> 16);
}
#endif

#ifdef AE_AVX2
static inline __m256 ae_load8(const ae_t* p) {
#if AE_DTYPE == 0
    return _mm256_loadu_ps(p);
#else
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#endif
}
#if AE_DTYPE != 0
// 8 floats rounded to bfloat16 as ae_put rounds each (nearest even; a NaN stays a NaN, quiet),
// in integer lanes: the same bits as ae_put, eight at a time.
static inline __m128i ae_bf16_round8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(  // |bits| > inf's, both nonnegative as int32
        _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i out = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // words 0-3 | 4-7 of each 128-bit lane (all < 2^16: no saturation), then lanes together
    return _mm256_castsi256_si128(
        _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08));
}
#endif
static inline void ae_store8(ae_t* p, __m256 v) {
#if AE_DTYPE == 0
    _mm256_storeu_ps(p, v);
#else
    _mm_storeu_si128((__m128i*)p, ae_bf16_round8(v));
#endif
}
// v rounded to the element type and back (what ae_store8 then ae_load8 give).
static inline __m256 ae_round8(__m256 v) {
#if AE_DTYPE == 0
    return v;
#else
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ae_bf16_round8(v)), 16));
#endif
}
static inline float ae_hsum8(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_hadd_ps(r, r); r = _mm_hadd_ps(r, r);
    return _mm_cvtss_f32(r);
}
// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (Cephes' expf coefficients, ~1 ulp), 2^n built in the exponent bits. Inputs are clamped
// to [-87.3, 88.7]: below, the result is ~1e-38 where the true one underflows to 0.
static inline __m256 ae_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(AE_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define AE_EXP16 1
// ae_exp8 on 16 lanes: the same operations, so the same floats lane for lane.
static inline __m512 ae_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                   _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
static inline __m512 ae_load16e(const ae_t* p) {  // 16 elements as floats
#if AE_DTYPE == 0
    return _mm512_loadu_ps(p);
#else
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#endif
}
static inline void ae_store16e(ae_t* p, __m512 v) {  // ae_store8 twice
    ae_store8(p, _mm512_castps512_ps256(v));
    ae_store8(p + 8, _mm512_extractf32x8_ps(v, 1));
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

// exp over n floats in place (vectorized where the CPU allows).
static inline void ae_exp_n(float* x, int64_t n) {
    int64_t i = 0;
#ifdef AE_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, ae_exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Input rows rounded to int8 per block of 32, twice, for byte dot products (int4.cpp and
// int8.cpp): x ~= d (xq + xr / 256) with d = max|x| / 127, exact to d / 512. Per block,
// interleaved like int4's (scale, min) pairs so that one vector op serves both:
// xa[2b] = d_b / 256, xa[2b + 1] = 0; xb[2b] = 0, xb[2b + 1] = sum of block b.
static inline void ae_quantize_rows(const float* x, int8_t* xq, int8_t* xr, float* xa,
                                    float* xb, int64_t M, int64_t K) {
    const int64_t blocks = K / 32;
    for (int64_t i = 0; i < M * blocks; ++i) {
        const float* xs = x + i * 32;
        int8_t* q = xq + i * 32;
        int8_t* r = xr + i * 32;
#ifdef AE_AVX2
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(xs + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        const __m256 dv = _mm256_set1_ps(d), iv = _mm256_set1_ps(inv);
        const __m256 iv256 = _mm256_set1_ps(inv * 256.f);
        __m256i qi[4], ri[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 rq = _mm256_round_ps(_mm256_mul_ps(v[j], iv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            qi[j] = _mm256_cvtps_epi32(rq);
            ri[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(rq, dv, v[j]), iv256));
        }
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        __m256i pq = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                        _mm256_packs_epi32(qi[2], qi[3]));
        __m256i pr = _mm256_packs_epi16(_mm256_packs_epi32(ri[0], ri[1]),
                                        _mm256_packs_epi32(ri[2], ri[3]));
        _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(pq, perm));
        // -128 would not survive int8.cpp's sign trick (-(-128) wraps): clamp to -127.
        pr = _mm256_max_epi8(pr, _mm256_set1_epi8(-127));
        _mm256_storeu_si256((__m256i*)r, _mm256_permutevar8x32_epi32(pr, perm));
        const float s = ae_hsum8(sum);
#else
        float amax = 0.f, s = 0.f;
        for (int j = 0; j < 32; ++j) { amax = std::max(amax, std::fabs(xs[j])); s += xs[j]; }
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < 32; ++j) {
            const float rq = std::nearbyint(xs[j] * inv);
            q[j] = (int8_t)rq;
            const float rr = std::nearbyint((xs[j] - rq * d) * inv * 256.f);
            r[j] = (int8_t)std::min(127.f, std::max(-127.f, rr));
        }
#endif
        xa[2 * i] = d / 256.f; xa[2 * i + 1] = 0.f;
        xb[2 * i] = 0.f; xb[2 * i + 1] = s;
    }
}

// The rounded input rows of a byte-dot call (int4.cpp, int8.cpp), in scratch of the calling
// thread kept between calls; the team reads them through these pointers.
struct ae_rounded { int8_t* xq; int8_t* xr; float* xa; float* xb; };
static inline ae_rounded ae_round_rows(const float* x, int64_t M, int64_t K) {
    static thread_local ae_vec<int8_t> q;
    static thread_local ae_vec<float> f;
    const int64_t blocks = K / 32;
    if ((int64_t)q.size() < 2 * M * K) q.resize(2 * M * K);
    if ((int64_t)f.size() < 4 * M * blocks) f.resize(4 * M * blocks);
    ae_rounded r{q.data(), q.data() + M * K, f.data(), f.data() + 2 * M * blocks};
    ae_quantize_rows(x, r.xq, r.xr, r.xa, r.xb, M, K);
    return r;
}
