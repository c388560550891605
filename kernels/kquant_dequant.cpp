#include "common.h"
#include "kquant.h"

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

extern "C" void kernel(const uint8_t* w, const int64_t* ids, ae_t* out, int64_t n, int64_t K,
                       int64_t type) {
    const AeWithoutGil released(n * K >= AE_RELEASE_GIL_ELEMENTS);
    const int64_t rb = kq_row_bytes(type, K);
#if AE_DTYPE == 0
    #pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) kq_dequant_row(type, w + ids[i] * rb, out + i * K, K);
#else
    #pragma omp parallel if (n * K >= 65536)
    {
        std::vector<float> row(K);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
            kq_dequant_row(type, w + ids[i] * rb, row.data(), K);
            kq_to_bf16(row.data(), out + i * K, K);
        }
    }
#endif
}
