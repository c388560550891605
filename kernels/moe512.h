// AVX-512 tiles of kernels/moe.cpp: one tile is 4 weight rows of one expert against MR (<= 4)
// of the rows routed to it, every weight vector loaded once for all MR rows and kept in
// registers, the 4 x MR dot products reduced together at the end (ae_sum16). `pf`: weights
// to fetch into the cache meanwhile (the rows a tile or two ahead).
//
// float32 experts: FMAs. bfloat16 experts: vdpbf16ps on the inputs rounded to bfloat16 where
// the CPU has it (as a bfloat16 model rounds its activations), else widened to float32 in
// registers and FMAs. int8 experts (a scale per row or per block of 32): the input rows
// rounded to int16, x ~= d h with d = max|x| / 32767 (exact to d / 2, ~1.5e-5 of the row's
// maximum), and int16 x int16 dot products (VNNI's vpdpwssd) on the sign-extended weight bytes:
//   w.x ~= scale_n d sum_k q_k h_k.
// int4 experts (int4.cpp's blocks of 32 with a float16 (scale, min)): byte dot products
// (vpdpbusd, unsigned weights u in [0, 15] x signed bytes) against the input rows rounded to
// int8 twice, as int4.cpp rounds them but with one scale per row:
//   x ~= d (q + r / 256),  d = max|x| / 127,  r = round((x - d q) 256 / d)
// so, per block b of 32,
//   sum_j (u_j s_b + m_b) x_j = s_b (d / 256) sum_j u_j (256 q_j + r_j) + m_b sum_j x_j,
// the byte sums converted to float per block pair (16 lanes, 8 per block) and weighted by
// s_b; the min term from the block sums of x, stored divided by d / 256 (`xb`).
#pragma once
// AE_MOE_NO512: without them (tests/executor/test_moe.py builds the portable path so).
#if !defined(AE_MOE_NO512) && defined(AE_AVX2) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define AE_MOE_512 1
#ifndef AE_MOE_HINT
#define AE_MOE_HINT _MM_HINT_T0
#endif

// Input rows of a tile: float rows (f); int16 rows (h, fac = d); or rows rounded twice (q, r,
// fac = d / 256) with xb: per block pair of 16 lanes [0, sum_b / fac] interleaved, as the
// float16 (scale, min) pairs are.
struct AeTileIn {
    const float* f;
    const uint16_t* b;  // bfloat16 rows (with the bfloat16 dot products)
    const int16_t* h;
    const int8_t* q;
    const int8_t* r;
    const float* fac;
    const float* xb;
    int64_t stride, xb_stride;
};

static inline __mmask16 ae_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

// max |x|, NaN where x has one (so that the row's factor is NaN and its results are, as
// float arithmetic's would be).
static inline float ae_absmax512(const float* x, int64_t K) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_maskz_loadu_ps(ae_mask16(K - k), x + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    return nan ? NAN : _mm512_reduce_max_ps(amax);
}

// x [K] -> h int16, fac = d.
static inline void ae_round16_row(const float* x, int64_t K, int16_t* h, float* fac) {
    const float d = ae_absmax512(x, K) / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = ae_mask16(K - k);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), iv));
        _mm256_mask_storeu_epi16(h + k, m, _mm512_cvtsepi32_epi16(v));
    }
    *fac = d;
}

// x [K] -> q, r, fac = d / 256; xb [xb_stride] (K a multiple of 32).
static inline void ae_round_row512(const float* x, int64_t K, int8_t* q, int8_t* r, float* fac,
                                   float* xb, int64_t xb_stride) {
    const float d = ae_absmax512(x, K) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512 dv = _mm512_set1_ps(d), iv = _mm512_set1_ps(inv);
    const __m512 iv256 = _mm512_set1_ps(inv * 256.f);
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_loadu_ps(x + k);
        const __m512 rq = _mm512_roundscale_ps(_mm512_mul_ps(v, iv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i ri = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fnmadd_ps(rq, dv, v), iv256));
        _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rq)));
        _mm_storeu_si128((__m128i*)(r + k), _mm512_cvtsepi32_epi8(ri));
    }
    *fac = d / 256.f;
    const float to = d > 0.f ? 256.f / d : 0.f;
    for (int64_t i = 0; i < xb_stride; ++i) xb[i] = 0.f;
    for (int64_t b = 0; b < K / 32; ++b)
        xb[2 * b + 1] = to * _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + 32 * b),
                                                                _mm512_loadu_ps(x + 32 * b + 16)));
}

// float32: rows w[j K] (j < 4) against inputs x[m]; res[4 m + j].
template <int MR>
static inline void ae_tile_f32(const float* w, int64_t K, const float* const* x, const float* pf,
                               float* res) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = ae_mask16(K - k);
        for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(pf + j * K + k), AE_MOE_HINT);
        __m512 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + k);
            for (int j = 0; j < 4; ++j) acc[4 * m + j] = _mm512_fmadd_ps(wv[j], xv, acc[4 * m + j]);
        }
    }
    _mm512_storeu_ps(res, ae_sum16(acc));
}

// bfloat16: rows w[j K] (j < 4), widened to float32 in registers (the FMAs as float32's);
// res[4 m + j].
template <int MR>
static inline void ae_tile_bf16(const uint16_t* w, int64_t K, const float* const* x,
                                const uint16_t* pf, float* res) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = ae_mask16(K - k);
        if ((k & 31) == 0)
            for (int j = 0; j < 4; ++j)
                _mm_prefetch((const char*)(pf + j * K + k), AE_MOE_HINT);
        __m512 wv[4];
        for (int j = 0; j < 4; ++j)
            wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w + j * K + k)), 16));
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + k);
            for (int j = 0; j < 4; ++j) acc[4 * m + j] = _mm512_fmadd_ps(wv[j], xv, acc[4 * m + j]);
        }
    }
    _mm512_storeu_ps(res, ae_sum16(acc));
}

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
// bfloat16 with the CPU's bfloat16 dot products (vdpbf16ps: two products per float lane, a
// call checks the CPU has them): the inputs rounded to bfloat16 (x[m], as a bfloat16 model's
// activations are), compiled for that extension alone; res[4 m + j].
#define AE_MOE_DPBF16 1
template <int MR>
__attribute__((target("avx512bf16"), noinline)) static void ae_tile_dpbf16(
        const uint16_t* w, int64_t K, const uint16_t* const* x, const uint16_t* pf, float* res) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~(__mmask32)0
                                           : (__mmask32)(((uint64_t)1 << (K - k)) - 1);
        for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(pf + j * K + k), AE_MOE_HINT);
        __m512bh wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
            for (int j = 0; j < 4; ++j)
                acc[4 * m + j] = _mm512_dpbf16_ps(acc[4 * m + j], wv[j], xv);
        }
    }
    _mm512_storeu_ps(res, ae_sum16(acc));
}

// x [K] floats -> bfloat16, rounded to nearest even (NaN stays NaN).
static inline void ae_round_bf16_row(const float* x, int64_t K, uint16_t* b) {
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = ae_mask16(K - k);
        const __m512i v = _mm512_castps_si512(_mm512_maskz_loadu_ps(m, x + k));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(v, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(v), _mm512_castsi512_ps(v),
                                                 _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(v, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(b + k, m, _mm512_cvtepi32_epi16(r));
    }
}
#endif

// int8: rows w[j K] (j < 4) with a scale per row (s[j], PER_BLOCK false) or per block of 32
// (s[j K / 32 + b], GGUF's Q8_0), against int16 inputs x[m] (factor fac[m]); res[4 m + j].
// Per row the int32 lanes take K / 16 products of at most 127 x 32767 each: they go to float
// every 4096 inputs (every block with its scale where PER_BLOCK).
template <int MR, bool PER_BLOCK>
static inline void ae_tile_q8(const int8_t* w, const float* s, int64_t K, const int16_t* const* x,
                              const float* fac, const int8_t* pf, float* res) {
    __m512 f[16];
    for (int i = 0; i < 16; ++i) f[i] = _mm512_setzero_ps();
    const int64_t chunk = PER_BLOCK ? 32 : 4096;
    for (int64_t c = 0; c < K; c += chunk) {
        __m512i acc[4 * MR];
        for (int i = 0; i < 4 * MR; ++i) acc[i] = _mm512_setzero_si512();
        const int64_t end = std::min<int64_t>(K, c + chunk);
        for (int64_t k = c; k < end; k += 32) {
            const __mmask32 mask = end - k >= 32 ? ~(__mmask32)0
                                                 : (__mmask32)(((uint64_t)1 << (end - k)) - 1);
            if ((k & 63) == 0)
                for (int j = 0; j < 4; ++j)
                    _mm_prefetch((const char*)(pf + j * K + k), AE_MOE_HINT);
            __m512i wv[4];
            for (int j = 0; j < 4; ++j)
                wv[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + j * K + k));
            for (int m = 0; m < MR; ++m) {
                const __m512i xv = _mm512_maskz_loadu_epi16(mask, x[m] + k);
                for (int j = 0; j < 4; ++j)
                    acc[4 * m + j] = _mm512_dpwssd_epi32(acc[4 * m + j], xv, wv[j]);
            }
        }
        if (PER_BLOCK) {
            for (int j = 0; j < 4; ++j) {
                const __m512 sb = _mm512_set1_ps(s[j * (K / 32) + c / 32]);
                for (int m = 0; m < MR; ++m)
                    f[4 * m + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[4 * m + j]), sb,
                                                   f[4 * m + j]);
            }
        } else {
            for (int i = 0; i < 4 * MR; ++i)
                f[i] = _mm512_add_ps(f[i], _mm512_cvtepi32_ps(acc[i]));
        }
    }
    float t[16];
    _mm512_storeu_ps(t, ae_sum16(f));
    const __m128 sv = PER_BLOCK ? _mm_set1_ps(1.f) : _mm_loadu_ps(s);
    for (int m = 0; m < MR; ++m)
        _mm_storeu_ps(res + 4 * m, _mm_mul_ps(_mm_mul_ps(sv, _mm_set1_ps(fac[m])),
                                              _mm_loadu_ps(t + 4 * m)));
}

// Two int4 blocks (32 bytes, int4.cpp's nibble order) as 64 bytes in input order; one block
// (the upper 32 bytes zero) where `one`.
static inline __m512i ae_unpack_q4x2(const uint8_t* p, bool one) {
    const __m256i bytes = one ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p))
                              : _mm256_loadu_si256((const __m256i*)p);
    const __m256i m = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(bytes, m);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m);
    // 128-bit lanes: lo b, lo b+1, hi b, hi b+1 -> lo b, hi b, lo b+1, hi b+1
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

// int4: rows w[j K / 2] (j < 4) with (scale, min) pairs sm[j blocks 2]; res[4 m + j].
template <int MR>
static inline void ae_tile_q4(const uint8_t* w, const uint16_t* sm, int64_t K,
                              const int8_t* const* q, const int8_t* const* r,
                              const float* const* xb, const float* fac, const uint8_t* pf,
                              float* res) {
    const int64_t blocks = K / 32;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < blocks; g += 8) {  // 8 blocks: 16 float16 (scale, min)
        const int64_t nb = std::min<int64_t>(8, blocks - g);
        const __mmask16 hm = (__mmask16)((1u << (2 * nb)) - 1u);
        __m512 sv[4];
        for (int j = 0; j < 4; ++j) {
            sv[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(hm, sm + j * 2 * blocks + 2 * g));
            for (int m = 0; m < MR; ++m)  // the min terms: [s, m] * [0, sum / fac]
                acc[4 * m + j] = _mm512_fmadd_ps(sv[j], _mm512_loadu_ps(xb[m] + 2 * g),
                                                 acc[4 * m + j]);
        }
        for (int64_t u = 0; 2 * u < nb; ++u) {  // block pair g + 2u, g + 2u + 1
            const int64_t b = g + 2 * u;
            const bool one = b + 1 == blocks;
            if ((b & 3) == 0)
                for (int j = 0; j < 4; ++j)
                    _mm_prefetch((const char*)(pf + j * (K / 2) + 16 * b), AE_MOE_HINT);
            const __m512i idx = _mm512_inserti64x4(
                _mm512_set1_epi32((int)(4 * u)), _mm256_set1_epi32((int)(4 * u + 2)), 1);
            const __mmask64 xm = one ? (__mmask64)0xffffffffu : ~(__mmask64)0;
            __m512i wv[4];
            for (int j = 0; j < 4; ++j) wv[j] = ae_unpack_q4x2(w + j * (K / 2) + 16 * b, one);
            for (int m = 0; m < MR; ++m) {
                const __m512i xq = _mm512_maskz_loadu_epi8(xm, q[m] + 32 * b);
                const __m512i xr = _mm512_maskz_loadu_epi8(xm, r[m] + 32 * b);
                for (int j = 0; j < 4; ++j) {
                    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xq);
                    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), wv[j], xr);
                    acc[4 * m + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),
                                                     _mm512_permutexvar_ps(idx, sv[j]),
                                                     acc[4 * m + j]);
                }
            }
        }
    }
    float t[16];
    _mm512_storeu_ps(t, ae_sum16(acc));
    for (int m = 0; m < MR; ++m)
        _mm_storeu_ps(res + 4 * m, _mm_mul_ps(_mm_set1_ps(fac[m]), _mm_loadu_ps(t + 4 * m)));
}
#endif
