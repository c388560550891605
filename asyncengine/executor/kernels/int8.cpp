#include "common.h"
#include <vector>

// One weight row into floats: w[k] = q[k] * scale of k's group.
static inline void ae_dequant_q8(const int8_t* qn, const float* sn, float* w, int64_t K,
                                 int64_t group) {
    for (int64_t g = 0; g < K / group; ++g) {
        const float scale = sn[g];
        const int64_t k0 = g * group;
#ifdef AE_AVX2
        const __m256 s = _mm256_set1_ps(scale);
        for (int64_t k = k0; k < k0 + group; k += 8) {
            const __m128i b = _mm_loadl_epi64((const __m128i*)(qn + k));
            _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
        }
#else
        for (int64_t k = k0; k < k0 + group; ++k) w[k] = (float)qn[k] * scale;
#endif
    }
}

// x: float [M, K]; q: int8 [N, K]; scales: float [N, K/group]; out: float [M, N].
// Each weight row is dequantized into L1 and multiplied in float32; from 4 input rows on, two
// weight rows at a time share each input load.
extern "C" void kernel(const float* x, const int8_t* q, const float* scales, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    const int64_t step = M >= 4 ? 2 : 1;
    #pragma omp parallel
    {
        std::vector<float> wbuf(2 * K);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < (N + step - 1) / step; ++i) {
            const int64_t n = i * step;
            ae_dequant_q8(q + n * K, scales + n * groups, wbuf.data(), K, group);
            if (step == 2 && n + 1 < N) {
                ae_dequant_q8(q + (n + 1) * K, scales + (n + 1) * groups, wbuf.data() + K, K,
                              group);
                ae_dots2(wbuf.data(), wbuf.data() + K, x, out + n, M, N, K);
            } else {
                ae_dots(wbuf.data(), x, out + n, M, N, K);
            }
        }
    }
}
