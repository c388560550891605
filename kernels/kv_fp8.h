// The KV cache's element type, ae_kv_t, for kv_write.cpp and decode_attention.cpp (and the
// decode stacks that include them). AE_KV_FP8 picks it:
//   0 (the default): the activations' ae_t, copied as it is;
//   1: float8 e4m3 ("fn": no infinities, largest finite 448), vLLM's --kv-cache-dtype fp8;
//   2: float8 e5m2 (largest finite 57344).
// A float8 cache holds the values themselves (a scale of 1, vLLM's without calibrated
// scales), each rounded to the nearest float8, ties to even, and saturated at the largest
// finite value: the bits of torch's x.clamp(-max, max).to(torch.float8_e4m3fn / e5m2). Read
// back, every float8 is exact in float32.
//
// Both float8 types widen through float16: an e5m2 byte is the top byte of the same float16;
// an e4m3 byte's exponent and mantissa moved down one bit are the float16 of the value / 2^8
// (4 exponent bits fit float16's 5, the bias differs by 8; subnormals included). So the
// loads below give the cached values divided by AE_KV_WIDEN (2^8 for e4m3, else 1), and
// attention multiplies its query scale and its output by AE_KV_WIDEN instead: scaling by a
// power of two is exact, so every product, sum and result has the bits it would have with
// the values themselves, and each load is four instructions (a bfloat16 load's two, plus a
// shift and a mask, or the float16 conversion).

#ifndef AE_KV_FP8
#define AE_KV_FP8 0
#endif

#if AE_KV_FP8 == 0
#define AE_KV_WIDEN 1.f
typedef ae_t ae_kv_t;
static inline float ae_kv_get(const ae_kv_t* p) { return ae_get(p); }
#ifdef AE_AVX2
static inline __m256 ae_kv_load8(const ae_kv_t* p) { return ae_load8(p); }
#endif
#if defined(__AVX512F__)
static inline __m512 ae_kv_load16(const ae_kv_t* p) {
#if AE_DTYPE == 0
    return _mm512_loadu_ps(p);
#else
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#endif
}
#endif
// n cache elements from n activations
static inline void ae_kv_put_row(ae_kv_t* dst, const ae_t* src, int64_t n) {
    std::memcpy(dst, src, n * sizeof(ae_t));
}

#else  // float8
typedef uint8_t ae_kv_t;
#if AE_KV_FP8 == 1
#define AE_F8_MANT 3
#define AE_F8_BIAS 7
#define AE_F8_MAX 448.f
#define AE_KV_WIDEN 256.f  // e4m3 read as float16 is the value / 2^8
#else
#define AE_F8_MANT 2
#define AE_F8_BIAS 15
#define AE_F8_MAX 57344.f
#define AE_KV_WIDEN 1.f
#endif

// The float16 bits of a float8 byte (the value / AE_KV_WIDEN). e4m3: the byte sign-extended
// and shifted up 7 puts the sign at bit 15 and exponent and mantissa at bits 13-7; the mask
// clears the copy of the sign at bit 14.
static inline uint16_t ae_f8_half(uint8_t x) {
#if AE_KV_FP8 == 1
    return (uint16_t)(((int16_t)(int8_t)x * 128) & 0xBFFF);
#else
    return (uint16_t)(x << 8);
#endif
}

static inline float ae_kv_get(const ae_kv_t* p) { return ae_half(ae_f8_half(*p)); }

#ifdef AE_AVX2
static inline __m256 ae_kv_load8(const ae_kv_t* p) {
    const __m128i x = _mm_loadl_epi64((const __m128i*)p);
#if AE_KV_FP8 == 1
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(x), 7),
                                         _mm_set1_epi16((short)0xBFFF)));
#else
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(x), 8));
#endif
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 ae_kv_load16(const ae_kv_t* p) {
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
#if AE_KV_FP8 == 1
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(x), 7),
                                            _mm256_set1_epi16((short)0xBFFF)));
#else
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(x), 8));
#endif
}
#elif defined(__AVX512F__)
static inline __m512 ae_kv_load16(const ae_kv_t* p) {
    float f[16];
    for (int i = 0; i < 16; ++i) f[i] = ae_kv_get(p + i);
    return _mm512_loadu_ps(f);
}
#endif

// One float to its float8 byte: saturated, rounded to nearest even (normal numbers by their
// bits, subnormals by the FPU's rounding of |v| / (their step), which is to nearest even).
static inline uint8_t ae_f8_of(float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    const uint32_t sign = (b >> 24) & 0x80;
    float a = std::fabs(v);
    if (!(a <= AE_F8_MAX)) a = AE_F8_MAX;  // NaN saturates too
    std::memcpy(&b, &a, 4);
    constexpr uint32_t shift = 23 - AE_F8_MANT;
    constexpr uint32_t min_normal = (uint32_t)(127 + 1 - AE_F8_BIAS) << 23;
    uint32_t code;
    if (b < min_normal)  // steps of 2^(1 - bias - mant): rounded by the FPU, ties to even
        code = (uint32_t)std::nearbyint(a * (float)(1 << (AE_F8_BIAS - 1 + AE_F8_MANT)));
    else
        code = ((b + ((1u << (shift - 1)) - 1) + ((b >> shift) & 1)) >> shift)
               - ((uint32_t)(127 - AE_F8_BIAS) << AE_F8_MANT);
    return (uint8_t)(code | sign);
}

static inline void ae_kv_put_row(ae_kv_t* dst, const ae_t* src, int64_t n) {
    int64_t i = 0;
#if defined(AE_EXP16) && defined(__AVX512BW__)
    constexpr int shift = 23 - AE_F8_MANT;
    const __m512 vmax = _mm512_set1_ps(AE_F8_MAX);
    const __m512 sub_scale = _mm512_set1_ps((float)(1 << (AE_F8_BIAS - 1 + AE_F8_MANT)));
    const __m512i min_normal = _mm512_set1_epi32((127 + 1 - AE_F8_BIAS) << 23);
    const __m512i half = _mm512_set1_epi32((1 << (shift - 1)) - 1);
    const __m512i bias = _mm512_set1_epi32((127 - AE_F8_BIAS) << AE_F8_MANT);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = ae_load16e(src + i);
        const __m512i b = _mm512_castps_si512(v);
        const __m512 a = _mm512_min_ps(_mm512_abs_ps(v), vmax);
        const __m512i ab = _mm512_castps_si512(a);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, shift), _mm512_set1_epi32(1));
        const __m512i normal = _mm512_sub_epi32(
            _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ab, half), odd), shift), bias);
        const __m512i subnormal = _mm512_cvtps_epi32(_mm512_mul_ps(a, sub_scale));
        __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(ab, min_normal), normal,
                                               subnormal);
        code = _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi32(b, 24),
                                                      _mm512_set1_epi32(0x80)));
        _mm_storeu_si128((__m128i*)(dst + i), _mm512_cvtepi32_epi8(code));
    }
#endif
    for (; i < n; ++i) dst[i] = ae_f8_of(ae_get(src + i));
}
#endif
