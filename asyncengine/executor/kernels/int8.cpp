#include "common.h"

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
