#include "common.h"
#include <vector>
#define kernel ae_int4_mm
#include "int4.cpp"
#undef kernel

// The weights [N, K] of int4 weights q [N, K / 2], sm [N, K / 32, 2] (int4.cpp's layout): w =
// q * scale + min per block of 32 (one float32 FMA), as the element type ae_t (AE_DTYPE):
// float32 for prefill chunks multiplied in float32; bfloat16 (that float rounded to nearest
// even once, as torch's .to(torch.bfloat16) of it) for those multiplied by PyTorch's bfloat16
// GEMM, without a float32 matrix written and read back in between (a row at a time through
// L1: SmolLM2's 3072 x 576 matrix 64 us against 48 + 76 us for float32 and then .to(), 2
// threads).
extern "C" void kernel(const uint8_t* q, const uint16_t* sm, ae_t* w, int64_t N, int64_t K) {
    const int64_t blocks = K / 32;
#if AE_DTYPE == 0
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
        ae_dequant_q4(q + n * (K / 2), sm + n * blocks * 2, w + n * K, blocks);
#else
    #pragma omp parallel
    {
        ae_vec<float> buf(K);
        float* row = buf.data();
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            ae_dequant_q4(q + n * (K / 2), sm + n * blocks * 2, row, blocks);
            ae_t* wn = w + n * K;
            int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
            // vcvtneps2bf16: nearest even; the values are never subnormal (multiples of 2^-24:
            // float16 scales and minimums times small integers), so it rounds as torch does
            for (; k + 16 <= K; k += 16)
                _mm256_storeu_si256((__m256i*)(wn + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#elif defined(AE_AVX2)
            for (; k + 8 <= K; k += 8) ae_store8(wn + k, _mm256_loadu_ps(row + k));
#endif
            for (; k < K; ++k) ae_put(wn + k, row[k]);
        }
    }
#endif
}
