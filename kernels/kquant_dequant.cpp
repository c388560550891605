#include "common.h"
#include "kquant.h"
#include "kquant_small.h"

// Rows ids[0..n) of a GGUF matrix w (rows of kq_row_bytes(type, K) bytes) into out [n, K] of
// the element type ae_t (AE_DTYPE), bit-exact with the `gguf` package's dequantize (kquant.h):
// float32 as it computes it; bfloat16 that rounded to nearest even once (as torch's
// .to(torch.bfloat16) of it), for the bfloat16 tiles of a prefill chunk or a decode batch,
// without a float32 copy of the tile in between. An embedding lookup dequantizes only the
// rows it looks up.
#if AE_DTYPE != 0
// float32 -> bfloat16, round to nearest even (NaN: a quiet NaN), n floats.
static inline void kq_to_bf16(const float* y, uint16_t* o, int64_t K) {
    int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    for (; k + 16 <= K; k += 16)  // vcvtneps2bf16: nearest even, NaN kept quiet
        _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(y + k)));
#endif
#ifdef AE_AVX2
    const __m256i lsb = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_loadu_ps(y + k);
        __m256i b = _mm256_castps_si256(v);
        b = _mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16),
                                                                        lsb)));
        b = _mm256_srli_epi32(b, 16);
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        b = _mm256_blendv_epi8(b, _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16),
                                                  _mm256_set1_epi32(0x40)), nan);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b),
                                                _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i*)(o + k), packed);
    }
#endif
    for (; k < K; ++k) ae_put(o + k, y[k]);
}
#endif

#ifdef AE_AVX2
// Q4_0 / Q4_1 / Q5_0 / Q5_1 rows with the quants unpacked 32 at a time (kq_quants32), the
// arithmetic kquant.h's: d q + m (two roundings), or d (q - off) (one).
template <int TYPE>
static inline void kq_dequant_row32(const uint8_t* src, float* y, int64_t K) {
    constexpr bool has_min = TYPE == KQ_Q4_1 || TYPE == KQ_Q5_1;
    constexpr int off = TYPE == KQ_Q4_0 ? 8 : 16;
    const int64_t bb = kq_row_bytes(TYPE, 32);
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = src + b * bb;
        const __m256i q = kq_quants32(blk, TYPE);
        const __m256 d = _mm256_set1_ps(kq_f16(blk));
        const __m256 m = _mm256_set1_ps(has_min ? kq_f16(blk + 2) : 0.f);
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i) {
            __m256i v = _mm256_cvtepu8_epi32(part[i]);
            if (!has_min) v = _mm256_sub_epi32(v, _mm256_set1_epi32(off));
            __m256 f = _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
            if (has_min) f = _mm256_add_ps(f, m);
            _mm256_storeu_ps(y + 32 * b + 8 * i, f);
        }
    }
}
#endif

// One row into y (float32), kquant.h's arithmetic.
static inline void kq_dequant_fast(int64_t type, const uint8_t* src, float* y, int64_t K) {
#ifdef AE_AVX2
    switch (type) {
        case KQ_Q4_0: kq_dequant_row32<KQ_Q4_0>(src, y, K); return;
        case KQ_Q4_1: kq_dequant_row32<KQ_Q4_1>(src, y, K); return;
        case KQ_Q5_0: kq_dequant_row32<KQ_Q5_0>(src, y, K); return;
        case KQ_Q5_1: kq_dequant_row32<KQ_Q5_1>(src, y, K); return;
        default: break;
    }
#endif
    kq_dequant_row(type, src, y, K);
}

extern "C" void kernel(const uint8_t* w, const int64_t* ids, ae_t* out, int64_t n, int64_t K,
                       int64_t type) {
    const AeWithoutGil released(n * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t rb = kq_row_bytes(type, K);
#if AE_DTYPE == 0
    #pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) kq_dequant_fast(type, w + ids[i] * rb, out + i * K, K);
#else
    #pragma omp parallel if (n * K >= 65536)
    {
        ae_vec<float> row(K);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            kq_dequant_fast(type, w + ids[i] * rb, row.data(), K);
            kq_to_bf16(row.data(), out + i * K, K);
        }
    }
#endif
}
