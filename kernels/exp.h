// exp(x) on vectors of 8 (AVX2) and 16 (AVX-512) floats, one polynomial for both widths:
// x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients,
// ~1 ulp), 2^n built in the exponent bits. Inputs are clamped to [-87.3, 88.7]: below, the
// result is ~1e-38 where the true one underflows to 0. Both widths run the same operations,
// so they give the same floats lane for lane.
#pragma once
#include "floats.h"

#ifdef AE_AVX2
// The operations the polynomial is written in, per width.
struct AeLanes8 {
    using V = __m256;
    static V set1(float f) { return _mm256_set1_ps(f); }
    static V min(V a, V b) { return _mm256_min_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
    static V round(V a) {
        return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    static V pow2(V n) {  // 2^n for integral n in range
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    }
};

template <class L>
static inline typename L::V ae_exp_lanes(typename L::V x) {
    using V = typename L::V;
    x = L::min(L::max(x, L::set1(-87.3f)), L::set1(88.7f));
    const V n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
    V r = L::fnmadd(n, L::set1(0.693359375f), x);
    r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
    V p = L::set1(1.9875691500e-4f);
    p = L::fmadd(p, r, L::set1(1.3981999507e-3f));
    p = L::fmadd(p, r, L::set1(8.3334519073e-3f));
    p = L::fmadd(p, r, L::set1(4.1665795894e-2f));
    p = L::fmadd(p, r, L::set1(1.6666665459e-1f));
    p = L::fmadd(p, r, L::set1(5.0000001201e-1f));
    p = L::fmadd(p, L::mul(r, r), L::add(r, L::set1(1.f)));
    return L::mul(p, L::pow2(n));
}

static inline __m256 ae_exp8(__m256 x) { return ae_exp_lanes<AeLanes8>(x); }
#endif

#ifdef AE_AVX512
#define AE_EXP16 1
struct AeLanes16 {
    using V = __m512;
    static V set1(float f) { return _mm512_set1_ps(f); }
    static V min(V a, V b) { return _mm512_min_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    static V round(V a) {
        return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    static V pow2(V n) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
    }
};

static inline __m512 ae_exp16(__m512 x) { return ae_exp_lanes<AeLanes16>(x); }
#endif

// exp over n floats in place (vectorized where the CPU allows).
static inline void ae_exp_n(float* x, int64_t n) {
    int64_t i = 0;
#ifdef AE_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, ae_exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}
