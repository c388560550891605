// Element types and float conversions: float16 to float, the layer kernels' element type ae_t
// (AE_DTYPE 0 = float32, 1 = bfloat16 stored as uint16_t) with its loads, stores and rounding.
#pragma once
#include "cpu.h"

#if defined(AE_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define AE_AVX512 1
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

// The layer kernels' element type. Arithmetic is float32; a bfloat16 result is rounded to
// nearest even once.
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
#endif

#ifdef AE_AVX512
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
